"""A capture rank of capture=online (dflash/stages/capture_role.py): the error that ends it is in its own log."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dflash.config import compose
from dflash.stages.capture_role import serve_capture


def test_the_error_that_ends_a_capture_rank_is_in_its_log(tmp_path):
    def stream_start():
        raise RuntimeError("trainer rank 0 went away")

    link = SimpleNamespace(rank=1, devices=["cpu"], stream_start=stream_start)
    cfg = compose(["+experiment=tiny", "show_progress=false", "capture=online", f"run_dir={tmp_path}"])
    with pytest.raises(RuntimeError, match="went away"):
        serve_capture(cfg, link)
    [log] = (tmp_path / "logs").glob("*-capture-rank1.log")
    text = log.read_text()
    assert "Traceback" in text and "RuntimeError: trainer rank 0 went away" in text
