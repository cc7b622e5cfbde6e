"""Nothing corrupt is trusted: checkpoints carry checksums, a corrupt latest tag is named and the run
resumes from the newest tag that verifies, ending with the weights of an uninterrupted run."""

import os

import pytest
import torch

from dflash.run_files import CHECKSUMS
from dflash.train.checkpoints import complete_tags, tag_problem, verified_latest_tag
from tests import trainer_harness


def flip(path: str) -> None:
    with open(path, "rb") as f:
        data = bytearray(f.read())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))


def model_states(folder: str) -> str:
    return next(os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.endswith("model_states.pt"))


def test_a_corrupt_latest_checkpoint_is_named_and_the_run_resumes_from_the_one_before(tmp_path, capsys):
    reference_losses, reference = trainer_harness.run(str(tmp_path / "reference"), 2, 1, save_every=2)
    out = tmp_path / "run"
    trainer_harness.run(str(out), 2, 1, save_every=2)
    checkpoints = str(out / "checkpoints")
    tags = [tag for _, tag in complete_tags(checkpoints)]
    assert len(tags) >= 2 and all(os.path.exists(os.path.join(checkpoints, t, CHECKSUMS)) for t in tags)
    latest = os.path.join(checkpoints, tags[-1])
    flip(model_states(latest))
    assert "differs from when it was saved" in tag_problem(checkpoints, tags[-1])
    assert verified_latest_tag(checkpoints) == tags[-2]
    capsys.readouterr()
    losses, state = trainer_harness.run(str(out), 2, 1, save_every=2)  # resumes from the tag before and finishes
    out_text, err = capsys.readouterr()
    assert f"checkpoint {latest} is corrupt" in err
    assert f"[train] resuming from the checkpoint of step {tags[-2].removeprefix('step')} " \
           f"({os.path.join(checkpoints, tags[-2])}): weights, optimizer, data position" in out_text + err
    assert losses == reference_losses
    for name, tensor in reference.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)
    assert tag_problem(checkpoints, tags[-1]) is None  # saved again, whole


def test_no_verifying_checkpoint_stops_naming_each(tmp_path):
    out = tmp_path / "run"
    trainer_harness.run(str(out), 2, 1, save_every=3, keep_last=2)
    checkpoints = str(out / "checkpoints")
    tags = [tag for _, tag in complete_tags(checkpoints)]
    for tag in tags:
        os.remove(model_states(os.path.join(checkpoints, tag)))
    with pytest.raises(ValueError, match="no checkpoint in .* verifies: " + ".*".join(
            rf"checkpoint .*{t} is corrupt: .*model_states.pt is missing" for t in reversed(tags))):
        verified_latest_tag(checkpoints)
