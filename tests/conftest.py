"""Shared fixtures: tiny random targets (built once per session) and a drafter factory sized for them."""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dflash.models.drafter import DFlashDraftModel
from dflash.models.drafter_config import DrafterConfig

# On CPU, DeepSpeed's process-group setup JIT-builds its shared-memory op (~40 s of compiling, minutes on a busy
# machine) into torch's extension cache, ~/.cache/torch_extensions/py311_cpu by default. That folder is shared by every
# checkout of the machine, and the build command names the virtualenv's paths: a test run after one from another
# checkout's virtualenv (a CI clone) rebuilt the op inside some test. One folder per environment: built once. Set here,
# before any test imports DeepSpeed; the processes the tests start inherit it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(
    Path.home() / ".cache" / "torch_extensions" / f"env-{hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]}"))


# xdist's --dist loadfile (README's command) hands a worker a whole file at a time, by default the files with the most
# tests first: the few-test files of processes and real models (a minute each) came last, and one worker ran them
# while the other had finished. Instead each worker sorts the files by a weight from their markers (a test that starts
# processes counts for 12, another slow one for 6, the rest 0.5: the fast lane's ~800 tests take 2 minutes), heaviest
# first, keeping each file's own order; and the scheduler hands them out in that order. Same files, same tests.
WEIGHTS = {"multiproc": 12.0, "slow": 6.0}


def marker_weight(item: pytest.Item) -> float:
    if item.get_closest_marker("gpu"):
        return 0.0  # skipped without CUDA
    return next((weight for name, weight in WEIGHTS.items() if item.get_closest_marker(name)), 0.5)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked `gpu` runs only where CUDA has its `devices` (default 1): on a CPU machine it is skipped, and
    on a GPU machine `pytest -m gpu` selects every CUDA test (the device sessions' command)."""
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return
    devices = marker.kwargs.get("devices", 1)
    if torch.cuda.device_count() < devices:
        needs = "a CUDA device" if devices == 1 else f"{devices} CUDA devices"
        reason = marker.kwargs.get("reason")
        pytest.skip(f"needs {needs}" + (f" ({reason})" if reason else ""))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # only in xdist's workers (which are not told the --dist mode)
        return
    weights: dict[Path, float] = {}
    for item in items:
        weights[item.path] = weights.get(item.path, 0.0) + marker_weight(item)
    items.sort(key=lambda item: -weights[item.path])  # stable: a file's tests keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class InCollectionOrder(LoadFileScheduling):
        """loadfile, the files in the workers' collection order rather than by their number of tests."""

        def schedule(self) -> None:
            by_count = self.config.option.loadscopereorder
            self.config.option.loadscopereorder = False
            try:
                super().schedule()
            finally:
                self.config.option.loadscopereorder = by_count

    return InCollectionOrder(config, log)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and spinning threads slow down ~10x when another process
    shares the 2 CPU cores of a CI machine. Subprocess tests set OMP_NUM_THREADS=1 for the same reason."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_target() -> Callable:
    """tiny_target(family) -> TargetAdapter with the built-in tokenizer (deterministic, offline); cached."""
    from dflash.models.targets import load_target

    cache: dict = {}

    def get(family: str):
        if family not in cache:
            cache[family] = load_target("tiny", tiny={"family": family, "seed": 0, "tokenizer": "builtin"})
        return cache[family]

    return get


@pytest.fixture(scope="session")
def varied_target() -> Callable:
    """varied_target(family, device="cpu", dtype="float32") -> a tiny dense target whose weights are large enough
    that greedy text varies (std 0.2; 0.02 repeats one token), with the built-in tokenizer; cached."""
    from dflash.models.targets import build_tiny_target

    cache: dict = {}

    def get(family: str, device: str = "cpu", dtype: str = "float32"):
        key = (family, device, dtype)
        if key not in cache:
            cache[key] = build_tiny_target(family, 0, tokenizer="builtin", initializer_range=0.2, device=device,
                                           dtype=dtype)
        return cache[key]

    return get


@pytest.fixture
def make_drafter() -> Callable:
    """make_drafter(adapter, layer_types=..., window=..., block_size=..., seed=..., std=...) -> DFlashDraftModel."""

    def build(adapter, layer_types=("sliding_attention", "full_attention"), window=8, block_size=4, seed=0,
              std=0.02, mask_token_id=3) -> DFlashDraftModel:
        config = DrafterConfig(
            hidden_size=adapter.hidden_size, intermediate_size=96, num_hidden_layers=len(layer_types),
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=adapter.vocab_size,
            num_target_layers=adapter.num_layers, target_layer_ids=[1, 3, 5], mask_token_id=mask_token_id,
            block_size=block_size, layer_types=list(layer_types),
            sliding_window=window if "sliding_attention" in layer_types else None,
        )
        drafter = DFlashDraftModel(config)
        drafter.init_weights(seed, std=std)
        return drafter.eval()

    return build
