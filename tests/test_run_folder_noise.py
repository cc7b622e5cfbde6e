"""What a command leaves besides its own work: Hydra writes no file (no <run_dir>/hydra/, not even for a refused
command), third-party progress bars stay off the console unless DFLASH_VERBOSE=1, and the log records a Hydra log
file used to catch are in the run's log file."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import datasets
import pytest

from dflash.console import console_copied_to
from dflash.console import VERBOSE_ENV
from dflash.train.third_party_output import third_party_records_to_run_log

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(cwd, *arguments: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != VERBOSE_ENV}
    return subprocess.run([sys.executable, "-m", "dflash.train", *arguments], cwd=cwd, capture_output=True,
                          text=True, env={**env, "PYTHONPATH": REPO}, timeout=120)


@pytest.fixture(autouse=True)
def not_verbose(monkeypatch):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)


def test_a_refused_command_leaves_nothing(tmp_path):
    # `name=` was refused in one line and still left runs/hydra/__main__.log beside the runs there.
    (tmp_path / "runs" / "other").mkdir(parents=True)
    done = command(tmp_path, "name=")
    assert done.returncode == 2 and done.stderr.startswith("dflash: error: name=''") and "Traceback" not in done.stderr
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["runs", "runs/other"]


@pytest.mark.parametrize("under", ["", "run"], ids=["the-file", "inside-it"])
def test_a_run_dir_that_is_a_file_is_refused_in_one_line(tmp_path, under):
    # Hydra made <run_dir>/hydra before any check: a NotADirectoryError traceback, where a line says what to mend.
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    run_dir = afile / under if under else afile
    done = command(tmp_path, "+experiment=tiny", f"run_dir={run_dir}")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.startswith(f"dflash: error: run_dir={str(run_dir)!r}") and done.stderr.count("\n") == 1
    assert afile.read_text() == "mine\n" and sorted(os.listdir(tmp_path)) == ["afile"]


def test_a_third_party_warning_reaches_the_run_log_too(tmp_path, capsys, monkeypatch):
    # Hydra's console handler took stdout before the run's console copy began: its records went to the console
    # alone (and to Hydra's own log file, now gone).
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stdout)
    monkeypatch.setattr(root, "handlers", [handler])  # Hydra's alone (not pytest's own)
    monkeypatch.setattr(root, "level", logging.INFO)
    library = logging.getLogger("a_library")
    path = tmp_path / "logs" / "run.log"
    with console_copied_to(str(path)), third_party_records_to_run_log():
        library.info("JAX version 0.11.2 available.")
        library.warning("a library warning the user must see")
    assert handler.stream is sys.stdout  # as it was
    assert capsys.readouterr().out == "a library warning the user must see\n"
    assert path.read_text().splitlines()[0].endswith("[a_library][INFO] - JAX version 0.11.2 available.")
    assert path.read_text().splitlines()[1:] == ["a library warning the user must see"]


@pytest.mark.parametrize("verbose", [False, True])
def test_the_dataset_saving_bar_is_hidden_unless_verbose(verbose, tmp_path, capsys, monkeypatch):
    # show_progress=true (the default) drew datasets' "Saving the dataset (1/1 shards)" bar under dflash's own lines.
    from dflash.data.dataset import FEATURES, _save_dataset

    if verbose:
        monkeypatch.setenv(VERBOSE_ENV, "1")
    rows = datasets.Dataset.from_dict({"id": ["a"], "input_ids": [[1, 2]], "loss_mask": [[0, 1]],
                                       "prompt_set": ["s"]}, features=FEATURES)
    datasets.utils.enable_progress_bars()
    _save_dataset(rows, tmp_path / "dataset")
    assert ("Saving the dataset" in capsys.readouterr().err) == verbose
    assert not datasets.utils.are_progress_bars_disabled()


def test_a_gguf_conversion_says_so_once(tmp_path, monkeypatch, capsys):
    # The first run on an empty cache showed transformers' bare bars and no line of dflash's saying what they were.
    from dflash.models.targets import gguf

    source = tmp_path / "model.Q4_1.gguf"
    source.write_bytes(b"GGUF")
    monkeypatch.setattr(gguf, "_convert", lambda source, target: (target.mkdir(), (target / gguf.SOURCE_FILE).touch()))
    target = tmp_path / "cache" / "model"
    gguf.convert_gguf_file(source, target)
    gguf.convert_gguf_file(source, target)  # converted already: nothing to say
    assert capsys.readouterr().out == f"[target] converting model.Q4_1.gguf once into {target} (kept for later runs)\n"
