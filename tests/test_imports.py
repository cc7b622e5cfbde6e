"""Dependencies point one way: no module imports from a layer above its own (house issue, point 6).

Layers, bottom to top: shared utilities (config, run files, console, host copies, inductor settings); models; the
inference engines (KV caches, static decoding, CUDA graphs, verification rules); data; capture (`extract`) and the
evaluator side by side, neither importing the other; train (which may use the evaluator for held-out acceptance);
the stages; the pipeline and the commands on top (docs/architecture.md).
"""

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = {"config": 0, "run_files": 0, "host_copy": 0, "inductor_settings": 0, "console": 0,
          "models": 1, "inference": 2, "data": 3, "extract": 4, "eval": 4, "train": 5, "stages": 6, "pipeline": 7}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "dflash" and len(parts) > 1 else None


def is_module(name: str) -> bool:
    """Whether `name` (dotted) is a module or package in this checkout."""
    path = os.path.join(REPO, *name.split("."))
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))


def imported_modules(module: str, source: str, is_package: bool = False) -> list[str]:
    """The modules that `source` (the text of `module`) imports, with relative imports made absolute.

    `from a import b` names a.b where b is a submodule and a otherwise, so `from dflash import train` counts as
    dflash.train and not as the package dflash, which sits on no layer.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                assert node.level <= len(parts), f"{module}: relative import above the top package"
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.append(f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base)
    return found


def imports() -> list[tuple[str, str]]:
    found = []
    for root, _, files in os.walk(os.path.join(REPO, "dflash")):
        for name in files:
            if not name.endswith(".py") or name == "__main__.py":  # commands sit on top of everything
                continue
            path = os.path.join(root, name)
            module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            with open(path, encoding="utf-8") as f:
                found += [(module, imported) for imported in imported_modules(module, f.read(), name == "__init__.py")]
    return found


def test_every_package_has_a_layer():
    packages = {package_of(m) for m, _ in imports()} - {None}
    assert packages <= set(LAYERS), f"give {sorted(packages - set(LAYERS))} a layer in tests/test_imports.py"


def against_layers(module: str, imported: str) -> bool:
    """Whether `module` importing `imported` points up, or sideways between two packages of one layer above 0."""
    source, target = package_of(module), package_of(imported)
    if source is None or target is None or source == target:
        return False
    return LAYERS[target] > LAYERS[source] or (LAYERS[target] == LAYERS[source] and LAYERS[source] > 0)


def test_no_module_imports_from_a_layer_above_or_beside_its_own():
    back = [f"{module} imports {imported}" for module, imported in imports() if against_layers(module, imported)]
    assert not back, "imports against the layers:\n" + "\n".join(back)


@pytest.mark.parametrize("module,imported,wrong", [
    ("dflash.extract.linked_source", "dflash.train.batches", True),   # capture reaching up into train
    ("dflash.eval.replay", "dflash.extract.store", True),      # the evaluator and capture side by side
    ("dflash.models.drafter", "dflash.data.chat", True),
    ("dflash.train.heldout", "dflash.eval.replay", False),     # train may use the evaluator
    ("dflash.eval.live", "dflash.inference.static_decode", False),
    ("dflash.pipeline", "dflash.train.loop", False),
    ("dflash.inference.static_decode", "dflash.data.chat", True),  # the engines sit below the data stage
    ("dflash.data.regenerate", "dflash.inference.static_decode", False),
    ("dflash.config.schema", "dflash.run_files", False),
])
def test_the_rule(module, imported, wrong):
    assert against_layers(module, imported) == wrong


@pytest.mark.parametrize("source,is_package", [
    ("from dflash import train", False),
    ("from dflash.train import heldout", False),
    ("from ..train import heldout", False),
    ("from .. import train", False),
    ("from ..train import heldout", True),
])
def test_the_walk_sees_package_and_relative_imports(source, is_package):
    module = "dflash.models" if is_package else "dflash.models.fake"
    assert any(against_layers(module, imported) for imported in imported_modules(module, source, is_package))
