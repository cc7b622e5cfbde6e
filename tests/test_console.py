"""The console copy of a command (dflash/console.py)."""

import logging
import sys

import pytest

from dflash.console import EVERY_RANK, console_copied_to


def test_what_is_printed_reaches_the_console_and_the_log(tmp_path, capsys):
    path = tmp_path / "logs" / "run.log"
    with console_copied_to(str(path)):
        print("[data] stage took 1.0 s")
        print("dflash: warning: x", file=sys.stderr)
        sys.stderr.write("\r 40%|####      | 4/10")  # a progress bar redrawn: not a line of the log
    print("after")  # no longer copied
    captured = capsys.readouterr()
    assert "[data] stage took 1.0 s" in captured.out and "dflash: warning: x" in captured.err
    assert path.read_text() == "[data] stage took 1.0 s\ndflash: warning: x\n"


def test_package_messages_reach_the_console_and_the_log_once(tmp_path, capsys):
    hydra_like = logging.StreamHandler(sys.stdout)  # Hydra's console handler on the root logger
    logging.getLogger().addHandler(hydra_like)
    try:
        path = tmp_path / "logs" / "run.log"
        with console_copied_to(str(path)):
            logging.getLogger("dflash.stages.capture").info("[capture] up to date: features")
            logging.getLogger("dflash.extract.capture").warning("[capture] warning: a small shard")
    finally:
        logging.getLogger().removeHandler(hydra_like)
    captured = capsys.readouterr()
    assert captured.out == "[capture] up to date: features\n"
    assert captured.err == "[capture] warning: a small shard\n"
    assert path.read_text() == "[capture] up to date: features\n[capture] warning: a small shard\n"


def test_other_ranks_show_only_warnings_and_their_own_work(capsys, monkeypatch):
    log = logging.getLogger("dflash.extract.capture")
    monkeypatch.setenv("RANK", "1")
    log.info("[capture] up to date: features")
    log.info("[capture] rank 1 of 2: 3 of 6 shards to capture", extra=EVERY_RANK)
    log.warning("[capture] 1 feature shard(s) missing")
    monkeypatch.setenv("RANK", "0")
    log.info("[capture] held-out: 4 samples")
    captured = capsys.readouterr()
    assert captured.out == "[capture] rank 1 of 2: 3 of 6 shards to capture\n[capture] held-out: 4 samples\n"
    assert captured.err == "[capture] 1 feature shard(s) missing\n"


@pytest.mark.parametrize("show_progress", [False, True])
def test_the_targets_loading_bars_follow_show_progress(show_progress, tmp_path, monkeypatch):
    # show_progress=false still drew transformers' "Loading weights" and "Writing model shards" bars when the target
    # loaded (seen on the H200's console).
    from transformers.utils import logging as hf_logging

    import dflash.models.targets as targets
    from dflash.config import compose
    from dflash.stages.context import RunContext

    seen = []
    monkeypatch.setattr(targets, "load_target", lambda *a, **k: seen.append(hf_logging.is_progress_bar_enabled()))
    hf_logging.enable_progress_bar()
    run = RunContext(compose(["+experiment=tiny", f"run_dir={tmp_path}", f"show_progress={show_progress}"]))
    run.target
    assert seen == [show_progress]
    assert hf_logging.is_progress_bar_enabled()


@pytest.mark.parametrize("show_progress", [False, True])
def test_the_gguf_conversion_bar_follows_show_progress(show_progress, capsys):
    # transformers' GGUF conversion draws a plain tqdm bar ("Converting and de-quantizing GGUF tensors...") that its
    # progress-bar switch does not reach: it stayed on the console under show_progress=false (seen on the H200).
    import transformers.modeling_gguf_pytorch_utils as gguf

    from dflash.console import transformers_progress_bars

    original = gguf.tqdm
    with transformers_progress_bars(show_progress):
        list(gguf.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
    assert ("Converting" in capsys.readouterr().err) == show_progress
    assert gguf.tqdm is original
