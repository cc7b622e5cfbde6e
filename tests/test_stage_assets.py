"""launch/stage_assets.sh: the target and prompt files cross in parts and come out whole, findable as packages, and
they are every packaged file a run reads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch" / "stage_assets.sh"

def packaged_files() -> list[str]:
    """package/file of every file a run reads from a PyPI package: the SmolLM2 GGUF and each prompt source's file."""
    from dflash.data.prompts import SOURCES
    from dflash.models.targets.smollm2 import GGUF_NAME, PACKAGE

    files = [f"{package}/{relative}" for package, relative, _ in SOURCES.values() if package is not None]
    return [f"{PACKAGE}/{GGUF_NAME}", *files]


def gemma3_270m_files() -> list[str]:
    """package/file of the Gemma 3 270M chunks, as dflash/models/targets/gemma3_270m.py finds them."""
    from dflash.models.targets.gemma3_270m import GGUF_NAME, PACKAGES

    return [f"{package}/data/{GGUF_NAME}.part{index:02d}" for index, package in enumerate(PACKAGES)]


def staged_files(array: str = "FILES") -> list[str]:
    """package/file of each line of the script's bash array `array`."""
    text = SCRIPT.read_text()
    block = text[text.index(f"\n{array}=(") + len(f"\n{array}=("):]
    block = block[:block.index("\n)")]
    return ["/".join(line.strip().strip('"').split(" ", 1)) for line in block.strip().splitlines()]


def test_the_script_stages_every_packaged_file_a_run_reads():
    assert sorted(staged_files()) == sorted(packaged_files())


def test_the_opt_in_gemma_list_is_the_chunks_the_target_joins():
    assert staged_files("GEMMA3_270M_FILES") == gemma3_270m_files()


def run(command: str, env: dict) -> subprocess.CompletedProcess:
    # No wheels unless a test carries some: the repository's own .whl folders must not be installed by a test.
    env = {"WHEEL_DIRS": "", **env}
    return subprocess.run(["bash", str(SCRIPT), command], env=env, capture_output=True, text=True, check=True)


@pytest.mark.skipif(shutil.which("xz") is None, reason="needs xz")
@pytest.mark.parametrize("with_gemma", [False, True], ids=["default", "with-gemma3-270m"])
def test_split_then_receive_part_by_part_restores_every_file(tmp_path, with_gemma):
    packages = tmp_path / "packages"  # small stand-ins for the PyPI packages' folders
    files = staged_files() + (gemma3_270m_files() if with_gemma else [])
    for relative in files:
        (packages / relative).parent.mkdir(parents=True, exist_ok=True)
        (packages / relative).write_bytes(os.urandom(3000))
    # An interpreter without site-packages, so the stand-ins are found even where the real packages are installed.
    python = tmp_path / "python-nosite"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "PYTHONPATH": str(packages), "PARTS": str(tmp_path / "parts"),
           "PART_BYTES": "4000", "STAGE_DIR": str(tmp_path / "stage"), "WITH_GEMMA3_270M": str(int(with_gemma))}
    run("split", env)
    parts = sorted(p.name for p in (tmp_path / "parts").iterdir())
    assert len(parts) >= 3
    sizes = [f.stat().st_size for f in (tmp_path / "parts").rglob("part-0*")]
    assert len(sizes) == len(parts) and max(sizes) <= 4000 and max(sizes) - min(sizes) < len(parts)
    for k, name in enumerate(parts, start=1):
        # Each transfer brings one part only, as on the GPU machine.
        transfer = tmp_path / f"transfer-{k}"
        shutil.copytree(tmp_path / "parts" / name, transfer / name)
        printed = run("receive", {**env, "PARTS": str(transfer)}).stdout
        assert ("export PYTHONPATH=" in printed) == (k == len(parts))
    site = tmp_path / "stage" / "site"
    for relative in files:
        assert (site / relative).read_bytes() == (packages / relative).read_bytes()
    assert (site / gemma3_270m_files()[0]).exists() == with_gemma
    assert printed.strip().startswith(f"export PYTHONPATH={site}")


@pytest.mark.skipif(shutil.which("xz") is None, reason="needs xz")
def test_every_file_travels_compressed(tmp_path):
    # The GGUF too: compressed, the pack goes in two transfers beside the wheels instead of three.
    packages = tmp_path / "packages"
    for relative in staged_files():
        (packages / relative).parent.mkdir(parents=True, exist_ok=True)
        (packages / relative).write_bytes(bytes(200_000))
    python = tmp_path / "python-nosite"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "PYTHONPATH": str(packages), "PARTS": str(tmp_path / "parts")}
    run("split", env)
    packed = sum(f.stat().st_size for f in (tmp_path / "parts").rglob("part-0*"))
    assert packed < 0.1 * 200_000 * len(staged_files())


def test_receive_refuses_parts_of_another_split(tmp_path):
    stage = tmp_path / "stage" / "parts"
    stage.mkdir(parents=True)
    (stage / "part-000").write_bytes(b"abc")
    (stage / "parts").write_text("1\n")
    (stage / "sha256").write_text("0" * 64 + "\n")
    env = {**os.environ, "PARTS": str(tmp_path / "none"), "STAGE_DIR": str(tmp_path / "stage"), "WHEEL_DIRS": ""}
    result = subprocess.run(["bash", str(SCRIPT), "receive"], env=env, capture_output=True, text=True)
    assert result.returncode == 1 and "do not match the sha256" in result.stderr


def test_receive_joins_only_the_parts_its_split_names(tmp_path):
    """A part an earlier split of more parts left in $STAGE_DIR/parts is left out of the join (it failed the
    checksum of every later receive), and named."""
    import hashlib
    import tarfile

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "file.txt").write_text("staged\n")
    with tarfile.open(tmp_path / "pack.tar", "w") as pack:
        pack.add(tmp_path / "pkg", arcname="pkg")
    packed = (tmp_path / "pack.tar").read_bytes()
    stage = tmp_path / "stage" / "parts"
    stage.mkdir(parents=True)
    (stage / "part-003").write_bytes(b"an earlier split's fourth part")
    part_1 = tmp_path / "transfer" / "part-1"  # this split's one part, with its count and checksum
    part_1.mkdir(parents=True)
    (part_1 / "part-000").write_bytes(packed)
    (part_1 / "parts").write_text("1\n")
    (part_1 / "sha256").write_text(hashlib.sha256(packed).hexdigest() + "\n")
    env = {**os.environ, "PARTS": str(tmp_path / "transfer"), "STAGE_DIR": str(tmp_path / "stage")}
    done = run("receive", env)
    assert done.stdout.startswith(f"export PYTHONPATH={tmp_path / 'stage' / 'site'}")
    assert (tmp_path / "stage" / "site" / "pkg" / "file.txt").read_text() == "staged\n"
    assert f"left out {stage / 'part-003'}: not one of this split's 1 parts" in done.stderr


def write_wheel(folder: Path, module: str) -> None:
    """A pure-Python wheel of one module whose `VALUE` is 7, with the metadata and RECORD pip checks."""
    import base64
    import hashlib
    import zipfile

    dist = f"{module}-0.1.dist-info"
    files = {f"{module}.py": "VALUE = 7\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    folder.mkdir(parents=True)
    with zipfile.ZipFile(folder / f"{module}-0.1-py3-none-any.whl", "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)


def test_receive_installs_the_carried_wheels_and_puts_them_on_the_path(tmp_path):
    # Each transfer carries a half of the wheels (no part here): both halves end up importable from $SITE.
    write_wheel(tmp_path / ".whl-a", "dflash_test_wheel_a")
    write_wheel(tmp_path / ".whl-b", "dflash_test_wheel_b")
    env = {**os.environ, "PYTHON": sys.executable, "PARTS": str(tmp_path / "none"), "SITE": str(tmp_path / "site"),
           "STAGE_DIR": str(tmp_path / "stage")}
    assert run("receive", env).stdout == ""  # nothing installed yet, nothing to put on the path
    for half in ("a", "b", "none"):  # a later transfer without wheels keeps them on the path
        printed = run("receive", {**env, "WHEEL_DIRS": str(tmp_path / f".whl-{half}")}).stdout
        assert printed.strip() == f"export PYTHONPATH={tmp_path / 'site'}:{REPO}${{PYTHONPATH:+:$PYTHONPATH}}"
    check = subprocess.run(["bash", "-c", f"unset PYTHONPATH; {printed.strip()}; {sys.executable} -c "
                            "'import dflash_test_wheel_a as a, dflash_test_wheel_b as b; print(a.VALUE + b.VALUE)'"],
                           capture_output=True, text=True, check=True)
    assert check.stdout.strip() == "14"
