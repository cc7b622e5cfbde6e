"""The analysis notebooks run top to bottom on the outputs of a tiny run (so they never rot), and are stored clean."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from dflash.config import compose
from dflash.pipeline import Pipeline

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
TINY = ["+experiment=tiny", "show_progress=false"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A tiny run (replay eval), and a copy of it re-evaluated in live mode: two runs with their own summaries."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        root = tmp_path_factory.mktemp("runs")
        replay_dir, live_dir = str(root / "replay_run"), str(root / "live_run")
        Pipeline(compose(TINY + [f"run_dir={replay_dir}"])).run()
        shutil.copytree(replay_dir, live_dir, ignore=shutil.ignore_patterns("eval"))
        Pipeline(compose(TINY + [f"run_dir={live_dir}", "stages=[eval]", "eval.mode=live",
                                 "+eval.chat_template_kwargs.enable_thinking=false"])).run()
    finally:
        torch.set_num_threads(threads)
    return replay_dir, live_dir


def execute(name: str, env: dict[str, str], tmp_path) -> str:
    """Run notebooks/<name> with `env` set for the kernel; returns all its text outputs joined."""
    with open(os.path.join(NOTEBOOKS, name), encoding="utf-8") as f:
        notebook = nbformat.read(f, as_version=4)
    saved = {key: os.environ.get(key) for key in [*env, "MPLBACKEND", "OMP_NUM_THREADS"]}
    os.environ.update({**env, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"})
    try:
        nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                                resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    texts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            assert output.get("output_type") != "error", output
            texts.append(output.get("text", ""))
    return "".join(texts)


def read_summary(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "eval", "summary.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.slow
def test_acceptance_notebook_runs_on_an_eval_output(two_runs, tmp_path):
    _, live_dir = two_runs
    text = execute("acceptance.ipynb", {"DFLASH_RUN_DIR": live_dir}, tmp_path)
    summary = read_summary(live_dir)
    assert "mode live" in text and "chat template kwargs {'enable_thinking': False}" in text
    assert summary["chat_template_kwargs"] == {"enable_thinking": False} and summary["mode"] == "live"
    for name, metrics in summary["prompt_sets"].items():
        assert f"tau[{name}] = {metrics['tau']:.3f}" in text
    assert f"tau[overall] = {summary['overall']['tau']:.3f}" in text
    assert f"tau[mtbench_both_turns] = {summary['both_turns']['mtbench']['tau']:.3f}" in text
    categories = summary["categories"]["mtbench"]  # the tiny run evaluates 2 MT-Bench prompts
    assert sum(m["num_prompts"] for m in categories.values()) == 2
    for label, metrics in categories.items():
        assert f"tau[mtbench/{label}] = {metrics['tau']:.3f}" in text


@pytest.mark.slow
def test_compare_runs_notebook_runs_on_two_runs(two_runs, tmp_path):
    replay_dir, live_dir = two_runs
    text = execute("compare_runs.ipynb", {"DFLASH_RUN_DIRS": os.pathsep.join([replay_dir, live_dir])}, tmp_path)
    assert "replay_run: eval yes" in text and "live_run: eval yes" in text
    with open(os.path.join(replay_dir, "metrics.jsonl"), encoding="utf-8") as f:
        last = json.loads(f.readlines()[-1])
    assert f"replay_run: last step {last['step']}, loss {last['loss']:.4f}" in text
    summary = read_summary(replay_dir)
    assert f"{summary['overall']['tau']:.3f}" in text
    assert "mtbench_both_turns" in text and f"{summary['both_turns']['mtbench']['tau']:.3f}" in text


@pytest.mark.parametrize("name", ["acceptance.ipynb", "compare_runs.ipynb"])
def test_notebooks_are_stored_without_outputs(name):
    with open(os.path.join(NOTEBOOKS, name), encoding="utf-8") as f:
        notebook = nbformat.read(f, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name} was committed with outputs"
    assert any("parameters" in cell.metadata.get("tags", []) for cell in notebook.cells)
