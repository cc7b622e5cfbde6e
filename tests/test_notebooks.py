"""The analysis notebooks run top to bottom from any working directory: on the outputs of a tiny run (so they never
rot) and with no run at all (one sentence says which command makes one); they are stored clean."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash.config import compose
from dflash.pipeline import Pipeline

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPOSITORY = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPOSITORY / "notebooks"
TINY = ["+experiment=tiny", "show_progress=false"]
MAKE_A_RUN = "`python -m dflash.train +experiment=tiny` in the repository makes one"


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


def checkout(root: Path, runs: dict[str, str] | None = None) -> Path:
    """A folder the notebooks take for the repository (pyproject.toml beside dflash/), with `runs` linked under its
    runs/; returns its notebooks/ folder, where Jupyter starts a notebook's kernel."""
    (root / "dflash").mkdir(parents=True)
    (root / "notebooks").mkdir()
    (root / "pyproject.toml").write_text('[project]\nname = "dflash-trainer"\n', encoding="utf-8")
    for name, target in (runs or {}).items():
        (root / "runs").mkdir(exist_ok=True)
        (root / "runs" / name).symlink_to(target, target_is_directory=True)
    return root / "notebooks"


def kernel_env(env: dict[str, str], cwd: Path) -> dict[str, str]:
    """os.environ for a kernel started in `cwd` by a shell there: the notebooks' variables only as given, figures
    drawn inline as Jupyter shows them."""
    base = {k: v for k, v in os.environ.items() if k not in ("DFLASH_RUN_DIR", "DFLASH_RUN_DIRS")}
    return {**base, **env, "PWD": str(cwd), "MPLBACKEND": "module://matplotlib_inline.backend_inline",
            "OMP_NUM_THREADS": "1"}


def execute(name: str, env: dict[str, str], cwd: Path):
    """Run notebooks/<name> with its kernel in `cwd` and `env` set; returns the executed notebook."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd)}}).execute(env=kernel_env(env, cwd))
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            assert output.get("output_type") != "error", output
    return notebook


def printed(notebook) -> str:
    return "".join(output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", []))


def figures(notebook) -> int:
    return sum("image/png" in output.get("data", {}) for cell in notebook.cells for output in cell.get("outputs", []))


def read_summary(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "eval", "summary.json"), encoding="utf-8") as f:
        return json.load(f)


def assert_acceptance_of(run_dir: str, text: str) -> None:
    summary = read_summary(run_dir)
    for name, metrics in summary["prompt_sets"].items():
        assert f"tau[{name}] = {metrics['tau']:.3f}" in text
    assert f"tau[overall] = {summary['overall']['tau']:.3f}" in text
    assert f"tau[mtbench_both_turns] = {summary['both_turns']['mtbench']['tau']:.3f}" in text


@pytest.mark.slow
def test_acceptance_opens_the_run_evaluated_last_from_the_notebooks_folder(two_runs, tmp_path):
    replay_dir, live_dir = two_runs  # the live run was evaluated after the replay run
    notebook = execute("acceptance.ipynb", {}, checkout(tmp_path, {"replay_run": replay_dir, "live_run": live_dir}))
    text = printed(notebook)
    assert str(tmp_path / "runs" / "live_run" / "eval" / "summary.json") in text
    assert "mode live" in text and "chat template kwargs {'enable_thinking': False}" in text
    assert_acceptance_of(live_dir, text)
    summary = read_summary(live_dir)
    assert summary["chat_template_kwargs"] == {"enable_thinking": False} and summary["mode"] == "live"
    categories = summary["categories"]["mtbench"]  # the tiny run evaluates 2 MT-Bench prompts
    assert sum(m["num_prompts"] for m in categories.values()) == 2
    for label, metrics in categories.items():
        assert f"tau[mtbench/{label}] = {metrics['tau']:.3f}" in text
    assert "humaneval: median " in text and " prompts; lowest: HumanEval/" in text  # eval/prompts.csv, its ids
    assert figures(notebook) >= 5


@pytest.mark.slow
def test_acceptance_opens_an_evaluation_written_to_a_folder_of_its_own(two_runs, tmp_path):
    """An evaluation into eval.out_dir (the closing block's next command writes eval_live/) was passed over: the
    notebook showed an older run's, and said that the run, or the folder named, had no evaluation."""
    replay_dir, live_dir = two_runs
    run = tmp_path / "made" / "mine"
    run.mkdir(parents=True)
    shutil.copytree(os.path.join(live_dir, "eval"), run / "eval_live")  # written after the replay run's
    shutil.copytree(os.path.join(replay_dir, "eval"), run / ".eval.tmp-1")  # a killed evaluation's half: passed over
    os.utime(run / ".eval.tmp-1" / "summary.json")  # the newest
    notebook = execute("acceptance.ipynb", {}, checkout(tmp_path / "checkout", {"replay_run": replay_dir,
                                                                                "mine": str(run)}))
    assert str(tmp_path / "checkout" / "runs" / "mine" / "eval_live" / "summary.json") in printed(notebook)
    assert_acceptance_of(live_dir, printed(notebook))
    for given in (run, run / "eval_live"):  # the run folder, or the evaluation's
        text = printed(execute("acceptance.ipynb", {"DFLASH_RUN_DIR": str(given)}, checkout(tmp_path / given.name)))
        assert f"{run / 'eval_live' / 'summary.json'}: mode live" in text


@pytest.mark.slow
def test_compare_runs_takes_every_run_by_default_and_relative_folders_from_anywhere(two_runs, tmp_path):
    replay_dir, live_dir = two_runs
    by_default = execute("compare_runs.ipynb", {},
                         checkout(tmp_path / "checkout", {"replay_run": replay_dir, "live_run": live_dir}))
    # Outside any checkout, folders relative to the repository are found from where dflash is installed.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    relative = os.pathsep.join(os.path.relpath(run, REPOSITORY) for run in (replay_dir, live_dir))
    given = execute("compare_runs.ipynb", {"DFLASH_RUN_DIRS": relative}, elsewhere)
    with open(os.path.join(replay_dir, "metrics.jsonl"), encoding="utf-8") as f:
        last = json.loads(f.readlines()[-1])
    summary = read_summary(replay_dir)
    for notebook in (by_default, given):
        text = printed(notebook)
        assert "replay_run: eval yes" in text and "live_run: eval yes" in text
        assert f"replay_run: last step {last['step']}, loss {last['loss']:.4f}" in text
        assert f"{summary['overall']['tau']:.3f}" in text
        assert "mtbench_both_turns" in text and f"{summary['both_turns']['mtbench']['tau']:.3f}" in text
        assert figures(notebook) == 2  # tau per run, the training curves


@pytest.mark.slow
def test_both_notebooks_find_a_run_nested_under_runs_by_default(two_runs, tmp_path):
    """`name=sweep/lr3e-3` makes runs/sweep/lr3e-3/: by default acceptance.ipynb looked one folder down from
    runs/<run> alone and compare_runs.ipynb at the folders right under runs/, so a repository whose only run was
    nested had none to show."""
    replay_dir, live_dir = two_runs
    notebooks = checkout(tmp_path)
    runs = tmp_path / "runs"
    run = runs / "sweep" / "lr3e-3"
    shutil.copytree(replay_dir, run)
    # Folders the walk passes over, each holding a newer evaluation (the live run's) and training records: one of
    # the run's own folders (checkpoints/, features/, ... are not walked), one of a run not trained or evaluated yet
    # (its config.yaml alone), a hidden one.
    pending = runs / "sweep" / "pending"
    pending.mkdir()
    shutil.copy(os.path.join(replay_dir, "config.yaml"), pending)
    for decoy in (run / "features" / "decoy", pending / "features" / "decoy", runs / ".trash" / "old"):
        shutil.copytree(os.path.join(live_dir, "eval"), decoy / "eval")
        shutil.copy(os.path.join(live_dir, "metrics.jsonl"), decoy)
    acceptance = printed(execute("acceptance.ipynb", {}, notebooks))
    assert f"{run / 'eval' / 'summary.json'}: mode replay" in acceptance
    assert_acceptance_of(replay_dir, acceptance)
    compared = execute("compare_runs.ipynb", {}, notebooks)
    listed = [line.split(": eval ")[0] for line in printed(compared).splitlines() if ": eval " in line]
    assert listed == ["sweep/lr3e-3"], listed  # named by its path under runs/
    assert f"{read_summary(replay_dir)['overall']['tau']:.3f}" in printed(compared)
    assert figures(compared) == 2


@pytest.mark.slow
def test_the_readme_command_executes_a_notebook_from_any_folder(two_runs, tmp_path):
    pytest.importorskip("nbconvert")
    replay_dir, _ = two_runs
    # `jupyter nbconvert` starts the kernel in notebooks/; the run is given relative to the repository root.
    env = kernel_env({"DFLASH_RUN_DIR": os.path.relpath(replay_dir, REPOSITORY)}, tmp_path)
    done = subprocess.run([sys.executable, "-m", "nbconvert", "--execute", "--to", "html", "--output-dir",
                           str(tmp_path), str(NOTEBOOKS / "acceptance.ipynb")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    page = (tmp_path / "acceptance.html").read_text(encoding="utf-8")
    assert_acceptance_of(replay_dir, page)


def test_compare_runs_puts_held_out_tau_against_the_lr_spent(tmp_path):
    """Two runs' held-out records, one run logging every step at twice the other's LR, the other every second
    step: a record's LR (the next step's) stands for the steps after it up to the next record."""
    runs = {}
    for name, lr, log_every in (("short", 4e-3, 1), ("long", 2e-3, 2)):
        folder = tmp_path / "made" / name
        folder.mkdir(parents=True)
        records = [{"step": s, "lr": lr, **({"heldout/tau": 1.0 + s / 10} if s % 4 == 0 else {})}
                   for s in range(log_every, 9, log_every)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        runs[name] = str(folder)
    notebook = execute("compare_runs.ipynb", {}, checkout(tmp_path / "checkout", runs))
    text = printed(notebook)
    assert "short: held-out tau 1.800 at step 8, LR sum 0.028" in text  # steps 2..8: 7 x 4e-3
    assert "long: held-out tau 1.800 at step 8, LR sum 0.012" in text  # steps 3..8: 6 x 2e-3
    assert figures(notebook) == 1  # no loss records: the held-out curves alone


@pytest.mark.parametrize("name", ["acceptance.ipynb", "compare_runs.ipynb"])
def test_with_no_run_a_notebook_says_which_command_makes_one(name, tmp_path):
    notebook = execute(name, {}, checkout(tmp_path))
    lines = printed(notebook).splitlines()
    assert len(lines) == 1 and f"under {tmp_path / 'runs'}: {MAKE_A_RUN}" in lines[0], lines
    assert figures(notebook) == 0


@pytest.mark.parametrize("name, variable", [("acceptance.ipynb", "DFLASH_RUN_DIR"),
                                            ("compare_runs.ipynb", "DFLASH_RUN_DIRS")])
def test_a_run_folder_that_is_not_there_is_named(name, variable, tmp_path):
    notebook = execute(name, {variable: os.path.join("runs", "gone")}, checkout(tmp_path))
    text = printed(notebook)
    assert f"No run folder {os.path.join('runs', 'gone')} here, in $PWD or in {tmp_path}" in text
    assert MAKE_A_RUN in text and figures(notebook) == 0


@pytest.mark.parametrize("name", ["acceptance.ipynb", "compare_runs.ipynb"])
def test_notebooks_are_stored_without_outputs(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name} was committed with outputs"
    assert any("parameters" in cell.metadata.get("tags", []) for cell in notebook.cells)


def test_compare_runs_table_keeps_its_columns_whatever_the_names(tmp_path):
    """Set names run to 18 characters (mtbench_both_turns) and run names are the user's: fixed widths ran the
    header's names together (`mtbenchmtbench_both_turnsmtbench_turn2`)."""
    runs = {}
    for name, tau in (("a_run_with_a_long_name", 2.5), ("b", 3.0)):
        folder = tmp_path / "made" / name
        (folder / "eval").mkdir(parents=True)
        summary = {"overall": {"tau": tau}, "prompt_sets": {"humaneval": {"tau": tau}, "mtbench": {"tau": tau - 1},
                                                            "mtbench_turn2": {"tau": tau + 1}},
                   "both_turns": {"mtbench": {"tau": tau}}}
        (folder / "eval" / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
        runs[name] = str(folder)
    text = printed(execute("compare_runs.ipynb", {}, checkout(tmp_path / "checkout", runs)))
    table = [line for line in text.splitlines() if line.split(" ")[0] in ("run", *runs)]
    assert len(table) == 3 and len({len(line) for line in table}) == 1, table
    assert table[0].split() == ["run", "overall", "humaneval", "mtbench", "mtbench_both_turns", "mtbench_turn2"]
