"""A checkpoint folder where no checkpoint verifies (dflash/train/checkpoints.py's verified_latest_tag) ends the
command with one line that names the folder, each corrupt tag and what to do: a CorruptFile, not a traceback."""

from __future__ import annotations

import re

import pytest

from dflash.config.errors import CorruptFile
from dflash.run_files import write_checksums
from dflash.train.checkpoints import COMPLETE, LATEST, verified_latest_tag


def test_no_verifying_checkpoint_is_a_corrupt_file_naming_the_folder_and_what_to_do(tmp_path):
    for step in (2, 4):
        folder = tmp_path / f"step{step}"
        folder.mkdir()
        (folder / "mp_rank_00_model_states.pt").write_bytes(b"x" * 64)
        write_checksums(str(folder))
        (folder / COMPLETE).write_text(f"{step}\n")
        (folder / "mp_rank_00_model_states.pt").write_bytes(b"y" * 64)  # changed after it was saved
    (tmp_path / LATEST).write_text("step4")
    with pytest.raises(CorruptFile) as error:
        verified_latest_tag(str(tmp_path))
    message = str(error.value)
    assert "\n" not in message
    assert re.search(rf"no checkpoint in {tmp_path} verifies: checkpoint .*step4 is corrupt: .*; checkpoint "
                     rf".*step2 is corrupt: ", message)
    assert message.endswith(f"Restore its files from a copy, or move {tmp_path} aside to train from the start")
