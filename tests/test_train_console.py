"""Third-party chatter (DeepSpeed, its op builder's compiler calls, wandb's banner and summary) stays off the console:
it goes to the run's log file, warnings still reach the console, and DFLASH_VERBOSE=1 shows everything."""

from __future__ import annotations

import contextlib
import glob
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash import console
from dflash.console import VERBOSE_ENV
from dflash.train import third_party_output
from dflash.train.metrics_log import MetricsLog
from dflash.train.third_party_output import quiet_deepspeed_logger, third_party_records_to_run_log, to_run_log
from tests.test_trainer import held_rendezvous

# Lines a tiny CPU run printed before: the op builder's probe, DeepSpeed's op build, wandb's banner and summary; and
# any record below WARNING that Hydra's root handler formats ("[datasets][INFO] - JAX version ... available").
CHATTER = ["gcc ", "-laio", "built successfully", "ds_accelerator", "[compilers", "wandb:", "Run history",
           "Run summary", "][INFO] - ", "][DEBUG] - "]


class CopiedConsole(io.StringIO):
    """A console whose output is also copied to a run log (as dflash/console.py's stream does)."""

    def __init__(self) -> None:
        super().__init__()
        self.log = io.StringIO()

    def write(self, text: str) -> int:
        self.log.write(text)
        return super().write(text)


@contextlib.contextmanager
def copied_console():
    """Inside, stdout is copied to a run log and the root logger has a console handler on it, as under Hydra."""
    stdout, previous = CopiedConsole(), sys.stdout
    handler = logging.StreamHandler(stdout)
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)  # as Hydra's job logging does
    root.addHandler(handler)
    sys.stdout = stdout  # set in the test itself: pytest sets its own capture back before the test runs
    outer, console._current_log = console._current_log, stdout.log  # what console_copied_to sets
    try:
        yield stdout
    finally:
        sys.stdout = previous
        console._current_log = outer
        root.removeHandler(handler)
        root.setLevel(level)


@pytest.fixture(autouse=True)
def not_verbose(monkeypatch):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)


def test_third_party_prints_and_info_records_go_to_the_run_log_only():
    with copied_console() as console:
        with to_run_log():
            print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
            logging.getLogger("compilers.C.base").info("gcc test.o -laio -o a.out")
            logging.getLogger("compilers.C.base").warning("a compiler warning the user must see")
        print("[train] our own line")
    on_console = console.getvalue()
    assert "built successfully" not in on_console and "-laio" not in on_console
    assert "a compiler warning the user must see" in on_console and "[train] our own line" in on_console
    logged = console.log.getvalue()
    assert "built successfully" in logged and "gcc test.o -laio" in logged and "[train] our own line" in logged


def test_a_runs_third_party_info_records_go_to_the_run_log_only():
    # Seen on the H200's console, from the root logger's handler that Hydra sets up: "[datasets][INFO] - JAX version
    # 0.11.2 available." and "[matplotlib.font_manager][INFO] - generated new fontManager". A run now keeps them in
    # its log file (dflash/pipeline.py wraps its stages in this).
    # Loggers of a library no test imports: the real ones' levels depend on which libraries an earlier test loaded.
    library, cache = logging.getLogger("a_library"), logging.getLogger("a_library.font_manager")
    with copied_console() as console, third_party_records_to_run_log():
        library.info("JAX version 0.11.2 available.")
        cache.info("generated new fontManager")
        library.warning("a library warning the user must see")
        print("[data] our own line")
    on_console = console.getvalue()
    assert "JAX version" not in on_console and "fontManager" not in on_console
    assert "a library warning the user must see" in on_console and "[data] our own line" in on_console
    logged = console.log.getvalue()
    assert "JAX version 0.11.2 available." in logged and "generated new fontManager" in logged
    assert not any(isinstance(f, third_party_output.BelowWarningToRunLog)
                   for h in logging.getLogger().handlers for f in h.filters)


def test_verbose_leaves_everything_on_the_console(monkeypatch):
    monkeypatch.setenv(VERBOSE_ENV, "1")
    with copied_console() as console, to_run_log():
        print("built successfully")
        logging.getLogger("compilers.C.base").info("gcc -laio")
    assert "built successfully" in console.getvalue() and "gcc -laio" in console.getvalue()


def test_deepspeeds_own_logger_keeps_its_warnings_on_the_console():
    quiet_deepspeed_logger()
    quiet_deepspeed_logger()  # once is enough: no second filter
    logger = logging.getLogger("DeepSpeed")
    assert sum(isinstance(f, third_party_output.BelowWarningToRunLog) for f in logger.filters) == 1
    level = logger.level
    logger.setLevel(logging.INFO)  # DeepSpeed's level in older releases (now WARNING: its INFO lines not even made)
    with copied_console() as console:
        own = logging.StreamHandler(console)  # DeepSpeed prints through a handler of its own, not the root's
        logger.addHandler(own)
        try:
            logger.info("Setting ds_accelerator to cpu (override)")
            logger.warning("a DeepSpeed warning")
        finally:
            logger.removeHandler(own)
            logger.setLevel(level)
    assert "ds_accelerator" not in console.getvalue() and "ds_accelerator" in console.log.getvalue()
    assert "a DeepSpeed warning" in console.getvalue()


@pytest.mark.parametrize("verbose", [False, True])
def test_wandb_starts_silent_unless_verbose(tmp_path, monkeypatch, verbose):
    wandb = pytest.importorskip("wandb")
    started = {}
    monkeypatch.setattr(wandb, "init", lambda **kwargs: started.update(kwargs))
    if verbose:
        monkeypatch.setenv(VERBOSE_ENV, "1")
    log = MetricsLog(str(tmp_path), enabled=True, tensorboard=False, wandb_mode="offline", wandb_project="t",
                     config={})
    with pytest.raises(AttributeError):  # the fake run has no id to record: wandb.init was called
        log.resume_from(0)
    assert started["settings"].silent is not verbose


@pytest.mark.slow
def test_a_tiny_run_prints_no_third_party_chatter(tmp_path):
    """The real command, wandb on (offline): the console holds the stages' own lines and none of the chatter, which
    the run's log file has (on a machine where DeepSpeed's op probe runs the compiler)."""
    repository = str(Path(__file__).resolve().parent.parent)
    env = {key: value for key, value in os.environ.items() if key != VERBOSE_ENV}
    env.update(PYTHONPATH=repository, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    # The run meets itself in a store this test holds, listening already: a port it picked itself or was handed
    # could be taken by another listener (the other xdist worker's) before its store bound it.
    with held_rendezvous() as rendezvous:
        done = subprocess.run([sys.executable, "-m", "dflash.train", "+experiment=tiny", f"run_dir={tmp_path}",
                               "stages=[data,capture,train]", "train.max_steps=2", "logging.wandb.mode=offline",
                               "show_progress=false"], env={**env, **rendezvous}, cwd=repository, timeout=600,
                              capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    console = done.stdout + done.stderr
    assert "[export] drafter ->" in console
    # What training came to, in one line before the final weights.
    assert "[train] done: 2 steps; over step 2: loss " in console and "estimated tau" in console
    # The frozen head's file is named with its size: the feature store's estimate counts the shards alone.
    assert "[capture] the target's embedding and lm_head, which the drafter shares frozen -> " in console
    assert [line for line in console.splitlines() if any(marker in line for marker in CHATTER)] == []
    assert glob.glob(str(tmp_path / "wandb" / "offline-run-*")), "wandb did not run"
    # One process starts DeepSpeed without its shared-memory op, whose JIT build printed "built successfully" after
    # the compiler's lines (dflash/train/engine.py, shm_op_skipped).
    logged = "".join(Path(path).read_text(encoding="utf-8") for path in glob.glob(str(tmp_path / "logs" / "*")))
    assert "built successfully" not in logged + console


def test_a_pipeline_run_keeps_third_party_info_records_off_the_console(tmp_path, monkeypatch):
    # The run's own wrapper (dflash/pipeline.py), not only the context manager: a library's INFO record made while a
    # stage runs lands in the run's log file, and its warning still on the console.
    from dflash.config import compose
    from dflash.pipeline import Pipeline
    from dflash.stages.data import DataStage

    def run(stage) -> None:
        logging.getLogger("a_library").info("JAX version 0.11.2 available.")
        logging.getLogger("a_library").warning("a library warning the user must see")

    monkeypatch.setattr(DataStage, "run", run)
    pipeline = Pipeline(compose(["+experiment=tiny", "show_progress=false", f"run_dir={tmp_path}", "stages=[data]"]))
    with copied_console() as console:
        pipeline.run()
    assert "JAX version" not in console.getvalue()
    assert "a library warning the user must see" in console.getvalue()
    logged = "".join(path.read_text(encoding="utf-8") for path in (tmp_path / "logs").iterdir())
    assert "JAX version 0.11.2 available." in logged


def test_the_ending_line_averages_the_last_steps_whole_records(tmp_path):
    from dflash.train.metrics_log import closing_records, ending_line

    assert closing_records(str(tmp_path)) == []
    lines = [{"step": 1, "loss": 3.0}] + [{"step": s, "loss": 1.5, "acc_pos1": 0.6, "accept_len_est": 2.4}
                                          for s in range(20, 1200, 20)]
    # The last step is an epoch's short micro-batch: alone it would read accuracy 0.
    lines.append({"step": 1200, "loss": 1.0, "acc_pos1": 0.0, "accept_len_est": 1.0, "heldout/tau": 2.87})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 1201, "lo')
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:  # torn by a kill, then a record without a count
        f.write('\n{"step": null, "loss": 1.0}\n')
    closing = closing_records(str(tmp_path))
    assert [r["step"] for r in closing] == list(range(1020, 1201, 20))  # 4 records in the last 5%: the last 10
    assert ending_line(closing) == (
        "[train] done: 1,200 steps; over the last 10 logged steps (1,020-1,200), on average: loss 1.450, "
        "first-position accuracy 0.540, estimated tau 2.26 (of the training batches); held-out tau 2.87; the eval "
        "stage measures tau on the prompt sets")
    assert ending_line(closing[-1:]).startswith("[train] done: 1,200 steps; over step 1,200: loss 1.000")
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:  # a longer run: its last 5% are 15 records
        f.write("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1220, 6001, 20)))
    assert [r["step"] for r in closing_records(str(tmp_path))] == list(range(5700, 6001, 20))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n"
                                                    for s in range(100, 1001, 100)))  # logged every 100 steps
    assert [r["step"] for r in closing_records(str(tmp_path))] == [800, 900, 1000]  # not back to step 100

def test_the_default_runs_line_comes_once_the_settings_passed_and_is_logged(tmp_path, monkeypatch, capsys):
    """The CPU demo's (or the GPU default's) line, chosen before Hydra, is said by the run: after every preflight,
    before the first stage's header, on the console and in the run's log."""
    from dflash.config import ConfigError, command_line, compose
    from dflash.pipeline import Pipeline

    monkeypatch.setattr(command_line, "_default_run_line", "dflash: no GPU: this is the CPU demo (a test's line)")
    Pipeline(compose(["+experiment=tiny", "show_progress=false", f"run_dir={tmp_path}", "stages=[data]"])).run()
    err, out = capsys.readouterr()[::-1]
    assert err.count("this is the CPU demo (a test's line)") == 1 and out.startswith("[data] ")
    logged = "".join(path.read_text(encoding="utf-8") for path in (tmp_path / "logs").iterdir())
    assert logged.index("this is the CPU demo (a test's line)") < logged.index("[data] ")
    Pipeline(compose(["+experiment=tiny", "show_progress=false", f"run_dir={tmp_path}", "stages=[data]"])).run()
    assert "CPU demo" not in capsys.readouterr().err  # a rerun that keeps everything: nothing to announce
    monkeypatch.setattr(command_line, "_default_run_line", "dflash: no GPU: this is the CPU demo (a test's line)")
    with pytest.raises(ConfigError):  # found by a preflight (no drafter to evaluate): its error alone, no line
        Pipeline(compose(["+experiment=tiny", f"run_dir={tmp_path / 'untrained'}", "stages=[eval]"])).run()
    assert "CPU demo" not in capsys.readouterr().err


def test_the_training_bar_shows_the_mean_of_its_last_steps():
    """An epoch's short last micro-batch (accuracy 0 on the CPU demo) moves the bar's figures by its share alone."""
    from collections import deque

    from tqdm import tqdm

    from dflash.train.loop import BAR_MEAN_STEPS, show_step

    bar, recent = tqdm(total=100, file=io.StringIO()), deque(maxlen=BAR_MEAN_STEPS)
    for step in range(30):
        show_step(bar, recent, {"loss": float(step), "acc": 0.5, "accept_len_est": 2.0})
    show_step(bar, recent, {"loss": 100.0, "acc": 0.0, "accept_len_est": 1.0})
    assert BAR_MEAN_STEPS == 20 and bar.n == 31
    # The last 20 steps: losses 11..29 and 100.
    assert bar.postfix == "acc=0.475, loss=24.000, tau=1.95"
