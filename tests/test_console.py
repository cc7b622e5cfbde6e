"""The console copy of a command (dflash/console.py)."""

import io
import logging
import sys

import pytest
from tqdm import tqdm

from dflash.console import EVERY_RANK, PIPED_BAR_EVERY, Tee, console_copied_to


class Terminal(io.StringIO):
    """A console that is a terminal."""

    def isatty(self) -> bool:
        return True


class Clock:
    """A clock that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def on_screen(text: str) -> list[str]:
    """The lines a terminal shows for `text`: each '\\r' goes back to the line's start and writes over it."""
    lines = []
    for line in text.split("\n"):
        cells: list[str] = []
        for part in line.split("\r"):
            cells[:len(part)] = part
        lines.append("".join(cells).rstrip())
    return lines


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


@pytest.mark.parametrize("verbose", [False, True])
def test_the_targets_loading_bars_are_hidden_unless_verbose(verbose, tmp_path, monkeypatch):
    # transformers' "Loading weights" and "Writing model shards" bars were drawn when the target loaded: under
    # show_progress=false (seen on the H200's console), and with every SmolLM2 run's default show_progress=true.
    from transformers.utils import logging as hf_logging

    import dflash.models.targets as targets
    from dflash.config import compose
    from dflash.stages.context import RunContext
    from dflash.console import VERBOSE_ENV

    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    if verbose:
        monkeypatch.setenv(VERBOSE_ENV, "1")
    seen = []
    monkeypatch.setattr(targets, "load_target", lambda *a, **k: seen.append(hf_logging.is_progress_bar_enabled()))
    hf_logging.enable_progress_bar()
    run = RunContext(compose(["+experiment=tiny", f"run_dir={tmp_path}", "show_progress=true"]))
    run.target
    assert seen == [verbose]
    assert hf_logging.is_progress_bar_enabled()


@pytest.mark.parametrize("verbose", [False, True])
def test_the_gguf_conversion_bar_is_hidden_unless_verbose(verbose, capsys, monkeypatch):
    # transformers' GGUF conversion draws a plain tqdm bar ("Converting and de-quantizing GGUF tensors...") that its
    # progress-bar switch does not reach: it stayed on the console under show_progress=false (seen on the H200).
    import transformers.modeling_gguf_pytorch_utils as gguf

    from dflash.console import VERBOSE_ENV, transformers_bars_hidden

    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    if verbose:
        monkeypatch.setenv(VERBOSE_ENV, "1")
    original = gguf.tqdm
    with transformers_bars_hidden():
        list(gguf.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
    assert ("Converting" in capsys.readouterr().err) == verbose
    assert gguf.tqdm is original


@pytest.mark.parametrize("console_kind", [Terminal, io.StringIO], ids=["terminal", "piped"])
def test_a_bar_leaves_its_last_state_as_one_line_of_the_log(console_kind):
    # Bars left blank lines in the run's log: its redraws were dropped, and tqdm's closing '\n' was kept alone.
    console, log = console_kind(), io.StringIO()
    tee = Tee(console, log, clock=Clock())
    tee.write("before\n")
    with tqdm(total=100, desc="regenerate", file=tee, mininterval=0) as bar:
        for _ in range(100):
            bar.update()
    tee.write("after\n")
    before, line, after = log.getvalue().split("\n")[:3]
    assert (before, after) == ("before", "after") and log.getvalue().count("\n") == 3
    assert line.startswith("regenerate: 100%") and line.endswith("]") and "\r" not in line
    assert on_screen(console.getvalue()) == ["before", line, "after", ""]


@pytest.mark.parametrize("console_kind", [Terminal, io.StringIO], ids=["terminal", "piped"])
def test_a_bar_cleared_away_leaves_nothing_in_the_log(console_kind):
    console, log = console_kind(), io.StringIO()
    tee = Tee(console, log, clock=Clock())
    with tqdm(total=3, file=tee, mininterval=0, leave=False) as bar:
        bar.update()
        bar.clear()
        tee.write("\n")  # a line printed after the bar was cleared (print()): it is the print's, not the bar's
        bar.update()
    assert log.getvalue() == "\n"


def test_a_piped_console_gets_a_bars_state_as_a_line_now_and_then():
    # Piped through tee, the console kept every redraw of a bar on one line: 35 KB for one bar.
    console, log, clock = io.StringIO(), io.StringIO(), Clock()
    tee = Tee(console, log, clock=clock)
    with tqdm(total=100, desc="short", file=tee, mininterval=0) as bar:
        for _ in range(100):
            bar.update()
    with tqdm(total=3, desc="long", file=tee, mininterval=0) as bar:
        for seconds in (PIPED_BAR_EVERY + 1, PIPED_BAR_EVERY + 1, 1):
            clock.now += seconds
            bar.update()
    assert "\r" not in console.getvalue()
    lines = console.getvalue().splitlines()
    assert [line.split("|")[0] for line in lines] == ["short: 100%", "long:  33%", "long:  67%", "long: 100%"]
    assert log.getvalue().splitlines() == [lines[0], lines[-1]]  # the log keeps the last state only


def test_a_piped_console_gets_a_bars_last_line_once_and_text_with_a_carriage_return_whole():
    console, log, clock = io.StringIO(), io.StringIO(), Clock()
    tee = Tee(console, log, clock=clock)
    tee.write("\rcopy:   0%| [00:00]")
    clock.now += PIPED_BAR_EVERY
    tee.write("\rcopy: 100%| [00:30]")  # shown as a line: its time had come
    tee.write("\rcopy: 100%| [00:31]")  # tqdm's close draws the bar once more (its time moved on), then ends it
    tee.write("\n")
    tee.write("a prompt's text, written on Windows\r\nends in CRLF\n")
    assert console.getvalue() == "copy: 100%| [00:30]\na prompt's text, written on Windows\r\nends in CRLF\n"
    assert log.getvalue() == "copy: 100%| [00:31]\na prompt's text, written on Windows\r\nends in CRLF\n"
    tee.write("\rstill:  40%| [00:00]")
    clock.now += 2 * PIPED_BAR_EVERY
    tee.write("\rstill:  40%| [01:00]")  # a bar that has not moved: no line until it does
    assert console.getvalue().endswith("CRLF\n")


@pytest.mark.parametrize("desc", ["[cap] x", "eval [replay]", "plain"])
def test_a_piped_console_gets_the_lines_of_a_bar_whatever_its_description(desc):
    """The progress a line shows is the text before tqdm's times, so brackets in a description count as progress;
    a bar that never moves still ends with its line."""
    console, clock = io.StringIO(), Clock()
    tee = Tee(console, io.StringIO(), clock=clock)
    with tqdm(total=2, desc=desc, file=tee, mininterval=0) as bar:
        clock.now += PIPED_BAR_EVERY
        bar.update()
    with tqdm(total=2, desc="stuck", file=tee, mininterval=0):
        clock.now += 2 * PIPED_BAR_EVERY
    lines = console.getvalue().splitlines()
    assert [line.split("|")[0] for line in lines] == [f"{desc}:  50%", "stuck:   0%"]  # its close adds no 50%


@pytest.mark.parametrize("console_kind", [Terminal, io.StringIO], ids=["terminal", "piped"])
def test_a_record_logged_while_a_bar_runs_gets_a_line_of_its_own(console_kind, monkeypatch):
    # Seen on the console: "train:   0%|   | 0/126 [00:00<?, ?it/s][train] ready after 1.0 s (engine, checkpoint)".
    console, log = console_kind(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", Tee(console, log))  # records go to stdout, bars to stderr: one terminal
    monkeypatch.setattr(sys, "stderr", Tee(console, log))
    with tqdm(total=3, desc="train", mininterval=0) as bar:
        bar.update()
        logging.getLogger("dflash.train.loop").info("[train] ready after 1.0 s (engine, checkpoint)")
        bar.update(2)
    shown = on_screen(console.getvalue())
    assert "[train] ready after 1.0 s (engine, checkpoint)" in shown
    assert shown[-2].startswith("train: 100%") and shown[-1] == ""
    logged = log.getvalue().splitlines()
    assert logged[0] == "[train] ready after 1.0 s (engine, checkpoint)" and logged[1].startswith("train: 100%")
