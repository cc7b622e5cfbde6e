"""overwrite=true moves a drafter aside with every evaluation of it in the run folder (eval/ and the folders that
eval.out_dir put there, such as the closing block's eval_live), and brings them back with it."""

from __future__ import annotations

from dflash.config import compose
from dflash.pipeline import Pipeline
from tests.test_run_folder_guard import snapshot

TINY = ["+experiment=tiny", "show_progress=false", "train.epochs=1"]


def test_an_eval_folder_in_the_run_folder_follows_its_drafter(tmp_path):
    first, second = TINY + [f"run_dir={tmp_path}"], TINY + [f"run_dir={tmp_path}", "train.lr=0.05"]
    live = ["stages=[eval]", f"eval.out_dir={tmp_path / 'eval_live'}"]
    Pipeline(compose(first)).run()
    Pipeline(compose(first + live)).run()
    of_first = snapshot(tmp_path / "eval_live")
    Pipeline(compose(second + ["overwrite=true"])).run()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("checkpoints.")]
    assert len(aside) == 1 and snapshot(aside[0] / "eval_live") == of_first
    assert not (tmp_path / "eval_live").exists()
    Pipeline(compose(second + live)).run()  # the second drafter's own evaluation, in the same folder name
    of_second = snapshot(tmp_path / "eval_live")
    assert of_second != of_first
    Pipeline(compose(first + ["overwrite=true"])).run()  # back: the first drafter with its evaluation
    assert snapshot(tmp_path / "eval_live") == of_first
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("checkpoints.")]
    assert len(aside) == 1 and snapshot(aside[0] / "eval_live") == of_second
