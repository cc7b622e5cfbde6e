"""Category labels of prompts, for metrics per category (MT-Bench: writing, roleplay, reasoning, math, ...)."""

from __future__ import annotations

import json
from pathlib import Path

from dflash.data.prompts import SOURCES, Prompt


def mtbench_categories(path: str | None = None) -> dict[str, str]:
    """Prompt id ("mtbench-<question_id>", as dflash.data.prompts names them) -> MT-Bench category."""
    import importlib.util

    if path is None:
        package, relative, _ = SOURCES["mtbench"]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"package {package!r} is not installed; pass the MT-Bench question file as path=")
        path = str(Path(spec.submodule_search_locations[0]) / relative)
    if not Path(path).is_file():
        raise FileNotFoundError(f"MT-Bench question file not found: {path}")
    labels = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                labels[f"mtbench-{record['question_id']}"] = str(record["category"])
    return labels


def prompt_categories(source: str, prompts: list[Prompt], path: str | None = None) -> list[str] | None:
    """One category per prompt for sources that have categories (mtbench), else None."""
    if source != "mtbench":
        return None
    labels = mtbench_categories(path)
    missing = [p.id for p in prompts if p.id not in labels]
    if missing:
        raise ValueError(f"prompts {missing[:5]} have no MT-Bench category in {path or 'the packaged file'}")
    return [labels[p.id] for p in prompts]
