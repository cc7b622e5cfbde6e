"""Folders of weights carry checksums: export/ and checkpoints/best/ are verified by what loads them; a
mismatch names the folder and the file; folders written before checksums.json load as before."""

import json
import os

import pytest
import torch

from dflash.config.errors import CorruptFile
from dflash.eval.export import export_zlab, load_drafter
from dflash.run_files import CHECKSUMS
from dflash.train.best_checkpoint import best_state_dict, read_best, write_best
from dflash.train.checkpoints import resume_tag
from tests import trainer_harness
from tests.test_checkpoint_integrity import flip
from tests.test_export import small_drafter


def test_an_export_carries_checksums_and_a_corrupt_one_is_named(tmp_path):
    out = export_zlab(small_drafter(), str(tmp_path / "export"), dtype=torch.float32)
    with open(os.path.join(out, CHECKSUMS), encoding="utf-8") as f:
        assert sorted(json.load(f)) == ["config.json", "model.safetensors"]
    load_drafter(out)
    flip(os.path.join(out, "model.safetensors"))
    with pytest.raises(CorruptFile, match=f"drafter folder {out} is corrupt: model.safetensors differs from when"):
        load_drafter(out)
    os.remove(os.path.join(out, "config.json"))
    with pytest.raises(CorruptFile, match="config.json is missing"):
        load_drafter(out)


def test_an_export_from_before_checksums_loads(tmp_path):
    drafter = small_drafter()
    out = export_zlab(drafter, str(tmp_path / "export"), dtype=torch.float32)
    os.remove(os.path.join(out, CHECKSUMS))
    loaded = load_drafter(out)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in drafter.state_dict().items())


def test_best_carries_checksums_and_a_corrupt_one_is_named_with_what_to_do(tmp_path):
    directory = str(tmp_path)
    info = {"step": 4, "tau": 1.5, "acceptance_rate": 0.3}
    write_best(directory, {"w": torch.arange(64.0)}, info)
    with open(tmp_path / "best" / CHECKSUMS, encoding="utf-8") as f:
        assert sorted(json.load(f)) == ["best.json", "model.safetensors"]
    assert best_state_dict(directory)[1] == info and read_best(directory, verify=True) == info
    flip(str(tmp_path / "best" / "model.safetensors"))
    folder = tmp_path / "best"
    expected = rf"best checkpoint {folder} is corrupt: model.safetensors differs .*\(mv {folder} {folder}.corrupt"
    with pytest.raises(CorruptFile, match=expected):
        best_state_dict(directory)
    with pytest.raises(CorruptFile, match=expected):
        read_best(directory, verify=True)
    assert read_best(directory) == info  # best.json alone is read unchecked (is there a best? which tau?)
    os.remove(folder / CHECKSUMS)  # a best/ from before checksums: loaded as it is
    assert best_state_dict(directory)[1] == info


def test_a_resume_verifies_the_best_checkpoint(tmp_path):
    trainer_harness.run(str(tmp_path), 2, 1)
    checkpoints = str(tmp_path / "checkpoints")
    write_best(checkpoints, {"w": torch.arange(64.0)}, {"step": 6, "tau": 1.5, "acceptance_rate": 0.3})
    assert resume_tag(checkpoints, 1, 0) == ("step6", False)
    flip(os.path.join(checkpoints, "best", "model.safetensors"))
    with pytest.raises(CorruptFile, match="best checkpoint .*best is corrupt: model.safetensors differs"):
        resume_tag(checkpoints, 1, 0)
