"""Layer-wise placement of one target over the GPUs of one capture worker: an HF `device_map`.

A target too large for one GPU (Qwen3.6-27B, ~50 GiB in bf16, on 48 GB cards) is split into contiguous runs of
decoder layers, one run per device; `from_pretrained(device_map=...)` (or `accelerate.dispatch_model`) loads
each run on its device and accelerate's hooks move a layer's inputs to it, so the HF model runs unchanged.

What is balanced: parameter (and buffer) bytes per device. The devices run one after the other (no pipelining),
so there is no compute to balance, only memory. The embedding (and any other module outside the decoder layers:
the rotary tables) sits on the first device, the final norm and an untied lm_head on the last; a tied lm_head
stays with the embedding it shares. Layers after the deepest tap are counted like the others: capture skips
them, but their weights take memory all the same, and `forward_with_features` and generation run them.

    device_map_for(model, ["cuda:0", "cuda:1"])  ->  {"model.embed_tokens": "cuda:0", "model.layers.0": "cuda:0",
        ..., "model.layers.63": "cuda:1", "model.norm": "cuda:1", "model.rotary_emb": "cuda:0", "lm_head": "cuda:1"}
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dflash.config.schema import TargetSettings
from dflash.models.targets.base import resolve_dtype

# Share of each GPU left free by `gpus_per_worker` for activations, the captured features and the CUDA context.
DEFAULT_RESERVE = 0.2

Devices = Sequence[str | int | torch.device] | str | int | torch.device


def parse_devices(devices: Devices) -> list[str]:
    """Normalise a device list to strings ("cpu", "cuda:N"; an int N means "cuda:N"); ValueError naming a bad one.

    All entries must be CPU or all CUDA: accelerate reads a "cpu" entry next to GPUs as CPU offload (weights
    copied to a GPU at every forward), which is not a placement.
    """
    items = [devices] if isinstance(devices, (str, int, torch.device)) else list(devices)
    if not items:
        raise ValueError("the device list is empty: give at least one device, e.g. ['cuda:0']")
    names = []
    for item in items:
        if isinstance(item, bool):
            raise ValueError(f"unknown device {item!r}: use 'cpu', 'cuda:N' or a GPU index N")
        if isinstance(item, int):
            item = f"cuda:{item}"
        try:
            device = torch.device(item)
        except (RuntimeError, TypeError):
            raise ValueError(f"unknown device {item!r}: use 'cpu', 'cuda:N' or a GPU index N") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {item!r} is not supported for a target: use 'cpu' or 'cuda:N'")
        names.append("cpu" if device.type == "cpu" else f"cuda:{device.index or 0}")
    if len({name.split(":")[0] for name in names}) > 1:
        raise ValueError(f"devices {names} mix CPU and CUDA: a target is placed on GPUs only or on the CPU only")
    return names


def check_available(devices: Sequence[str]) -> None:
    """ValueError when a CUDA device of the list is not visible to this process."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for name in devices:
        if name.startswith("cuda:") and int(name.split(":")[1]) >= count:
            raise ValueError(f"device {name} is not available: this process sees {count} GPU(s) "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")


def split_layers(layer_bytes: Sequence[int], num_devices: int, first_bytes: int = 0,
                 last_bytes: int = 0) -> list[range]:
    """Contiguous runs of layer indices, one per device, with about equal bytes per device.

    `first_bytes` (embedding) counts on the first device, `last_bytes` (norm, head) on the last. Each cut is the
    layer boundary nearest to an even share of the total, so every device is within one layer's bytes of its
    share whenever the embedding and head are smaller than a share.
    """
    n = len(layer_bytes)
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if num_devices > n:
        raise ValueError(f"{num_devices} devices for a target with {n} decoder layers: every device needs at least "
                         f"one whole layer, so use at most {n} devices")
    prefix = [int(first_bytes)]
    for size in layer_bytes:
        prefix.append(prefix[-1] + int(size))
    total = prefix[-1] + int(last_bytes)
    cuts = [0]
    for i in range(1, num_devices):
        share = total * i / num_devices
        # Leave at least one layer for this run and for each run after it.
        candidates = range(cuts[-1] + 1, n - (num_devices - i) + 1)
        cuts.append(min(candidates, key=lambda j: abs(prefix[j] - share)))
    cuts.append(n)
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def module_bytes(module: nn.Module) -> int:
    """Bytes of the parameters and buffers of `module` (meta tensors count their would-be size)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _layout(model: nn.Module) -> tuple[nn.ModuleList, nn.Module]:
    """The decoder layers and the final norm of `model`, found by its family's adapter."""
    from dflash.models.targets.registry import adapter_for

    shell = adapter_for(model).layout_of(model)
    return shell.decoder_layers(), shell.final_norm()


def device_map_for(model: nn.Module, devices: Devices) -> dict[str, str]:
    """An HF device_map placing `model`'s decoder layers in contiguous byte-balanced runs over `devices`.

    `model` may live on the meta device (see `empty_model`). Every parameter and buffer is covered by exactly
    one key; each decoder layer is one key, so a layer is never split.
    """
    names = parse_devices(devices)
    layers, norm = _layout(model)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    last_modules = [norm] if tied or head is None else [norm, head]
    layer_path = next((name for name, module in model.named_modules() if module is layers), None)
    if layer_path is None:
        raise ValueError(f"the decoder layers of {type(model).__name__} are not a submodule of it")
    outside: dict[str, nn.Module] = {}

    def collect(module: nn.Module, prefix: str) -> None:
        # Walk down to the layer list; every module beside that path is placed whole.
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if own:
            raise ValueError(f"module {prefix or type(model).__name__!r} holds tensors next to the decoder layers; "
                             f"it cannot be placed layer-wise")
        for child_name, child in module.named_children():
            path = f"{prefix}{child_name}"
            if child is layers:
                continue
            if layer_path.startswith(path + "."):
                collect(child, path + ".")
            else:
                outside[path] = child

    collect(model, "")
    last_paths = {path for path, module in outside.items() if any(module is m for m in last_modules)}
    # A tied head shares the embedding's weight: its bytes are already counted.
    first_bytes = sum(module_bytes(m) for p, m in outside.items() if p not in last_paths and not (tied and m is head))
    last_bytes = sum(module_bytes(outside[p]) for p in last_paths)
    runs = split_layers([module_bytes(layer) for layer in layers], len(names), first_bytes, last_bytes)
    device_map = {}
    for run, device in zip(runs, names):
        for index in run:
            device_map[f"{layer_path}.{index}"] = device
    for path in outside:
        device_map[path] = names[-1] if path in last_paths else names[0]
    return device_map


def describe(device_map: dict[str, str]) -> str:
    """One line per device of a layer-wise map, e.g. "cuda:0: layers 0-31; cuda:1: layers 32-63"."""
    runs: dict[str, list[int]] = {}
    for key, device in device_map.items():
        last = key.rsplit(".", 1)[-1]
        if last.isdigit():
            runs.setdefault(device, []).append(int(last))
    return "; ".join(f"{device}: layers {min(ids)}-{max(ids)}" for device, ids in runs.items())


def empty_model(config: Any, dtype: torch.dtype) -> nn.Module:
    """The *ForCausalLM that `AutoModelForCausalLM.from_pretrained` builds for `config`, with meta weights."""
    from transformers import AutoModelForCausalLM

    # The meta device context, not accelerate's init_empty_weights: that one leaves a tied lm_head untied.
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def gpus_per_worker(model_bytes: int, gpu_bytes: int, reserve: float = DEFAULT_RESERVE) -> int:
    """GPUs one capture worker needs so that the weights leave `reserve` of every GPU free.

    Qwen3.6-27B (53.8 GB in bf16): 2 on 48 GB cards, 1 on 80 GB and 141 GB cards.
    """
    if gpu_bytes <= 0 or not 0 <= reserve < 1:
        raise ValueError(f"gpus_per_worker needs gpu_bytes > 0 and 0 <= reserve < 1, got {gpu_bytes}, {reserve}")
    return max(1, math.ceil(model_bytes / (gpu_bytes * (1 - reserve))))


def target_settings(target: TargetSettings | Mapping[str, Any]) -> TargetSettings:
    """`target` as TargetSettings: the run's own, or a target group as a dict (conf/target/*.yaml, as the launch
    scripts read it) checked and given the schema's defaults."""
    return target if isinstance(target, TargetSettings) else TargetSettings(**target)


def target_bytes(target: TargetSettings | Mapping[str, Any], dtype: torch.dtype = torch.bfloat16) -> int:
    """Weight bytes of a target (target_settings) in `dtype`, without loading weights."""
    target = target_settings(target)
    kind = target.kind
    if kind == "hf":
        from dflash.config.target_path import target_path_problem
        from dflash.models.targets.preflight import checkpoint_config

        path = os.path.expanduser(str(target.path))
        problem = target_path_problem(path)
        if problem is not None:
            raise FileNotFoundError(f"target path {path}: {problem}")
        return module_bytes(empty_model(checkpoint_config(path, target.cache_dir), dtype))
    if kind == "tiny":
        from dflash.models.targets.tiny import build_tiny_target

        spec = dict(target.tiny or {})
        family, seed = spec.pop("family"), int(spec.pop("seed", 0))
        spec.pop("tokenizer", None)  # the weights' bytes: any tokenizer of the same vocabulary size will do
        return module_bytes(build_tiny_target(family, seed, tokenizer="builtin", dtype=dtype, **spec).model)
    if kind == "smollm2":
        return 135_000_000 * torch.finfo(dtype).bits // 8  # SmolLM2-135M: no need to convert the GGUF to know
    raise ValueError(f"unknown target kind {kind!r}")


def resolve_gpus_per_worker(setting: int | str | None, target: TargetSettings | Mapping[str, Any],
                            num_devices: int, gpu_bytes: int | None = None) -> int:
    """`capture.gpus_per_worker` as a number that divides `num_devices` (the capture GPUs).

    An int is taken as given; "auto" (or None) asks `gpus_per_worker` with the target's weight bytes in the dtype
    it loads in on a GPU (`target.dtype`; "auto" is bf16) and the memory of GPU 0 (all capture GPUs are assumed
    alike); without CUDA it is 1.
    """
    if setting is None or str(setting) == "auto":
        if gpu_bytes is None:
            if not torch.cuda.is_available():
                return 1
            gpu_bytes = torch.cuda.get_device_properties(0).total_memory
        target = target_settings(target)
        count = gpus_per_worker(target_bytes(target, resolve_dtype(target.dtype, "cuda")), gpu_bytes)
    else:
        try:
            count = int(setting)
        except ValueError:
            raise ValueError(f"capture.gpus_per_worker={setting!r}: expected a positive int or 'auto'") from None
    if count < 1:
        raise ValueError(f"capture.gpus_per_worker={setting!r}: expected a positive int or 'auto'")
    if num_devices % count:
        raise ValueError(f"capture.gpus_per_worker={count} does not divide the {num_devices} capture GPU(s): list a "
                         f"multiple of {count} GPUs in capture.devices")
    return count


def rank_devices(local_rank: int, gpus: int) -> list[str]:
    """The GPUs of capture process `local_rank` when each process takes `gpus` consecutive visible GPUs."""
    return [f"cuda:{local_rank * gpus + j}" for j in range(gpus)]


def job_rank_devices(local_rank: int, local_trainers: int, gpus: int) -> list[str]:
    """The GPUs of local rank `local_rank` in a one-node job whose first `local_trainers` ranks train on one GPU
    each and whose other ranks capture on `gpus` consecutive GPUs each, visible in that order (trainer GPUs, then
    capture GPUs: launch/one_node.sh)."""
    if local_rank < local_trainers:
        return [f"cuda:{local_rank}"]
    first = local_trainers + (local_rank - local_trainers) * gpus
    return [f"cuda:{first + j}" for j in range(gpus)]
