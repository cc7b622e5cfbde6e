"""Repository rules that keep the project honest: README commands, CI, the DeepSpeed seam."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_commands():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_starts_with_exactly_two_commands_run_main_job_and_tests():
    commands = readme_commands()
    assert len(commands) == 2
    assert commands[0].endswith("python -m dflash.train")
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_commands()[1] in ci


def test_deepspeed_is_imported_in_one_file_only():
    importers = sorted(
        str(path.relative_to(ROOT)) for path in (ROOT / "dflash").rglob("*.py")
        if re.search(r"^\s*(import deepspeed|from deepspeed)", path.read_text(), re.M)
    )
    assert importers == ["dflash/train/engine.py"]


def test_no_trust_remote_code_and_no_unsafe_torch_load():
    for path in (ROOT / "dflash").rglob("*.py"):
        text = path.read_text()
        assert "trust_remote_code=True" not in text, path
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, (path, call)


def test_no_function_in_the_package_is_longer_than_a_screen():
    """Functions over 80 lines are split into steps with names (house issue, point 7)."""
    import ast

    long = []
    for path in (ROOT / "dflash").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})")
    assert not long, "\n".join(long)


def test_no_line_of_python_is_wider_than_120_columns():
    wide = [f"{path.relative_to(ROOT)}:{number} ({len(line)})"
            for folder in ("dflash", "tests", "bench", "launch") for path in (ROOT / folder).rglob("*.py")
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if len(line) > 120]
    assert not wide, "\n".join(wide)



def test_cuda_tests_carry_the_gpu_mark_and_do_not_skip_themselves():
    """Every CUDA test is marked `gpu` (conftest.py skips it where the devices are missing), so that `pytest -m gpu`
    on a GPU machine runs all of them; a test that skipped on its own check of CUDA was left out of that run."""
    own = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines() + [""]
        for number, (line, after) in enumerate(zip(lines, lines[1:]), 1):
            checks_cuda = re.search(r"cuda\.(is_available|device_count)\(", line)
            if path.name != "conftest.py" and checks_cuda and "skip" in line + after:
                own.append(f"{path.relative_to(ROOT)}:{number}")
    assert not own, "\n".join(own)
