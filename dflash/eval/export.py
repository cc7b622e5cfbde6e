"""Export a drafter in the z-lab checkpoint format, and load one back (ours or a published z-lab drafter).

A z-lab drafter folder holds `config.json` (DrafterConfig.to_zlab(): a Qwen3 config plus dflash_config) and
`model.safetensors` with only the drafter's own tensors: layers.*, fc, hidden_norm, norm (method.md §1). That is
what vLLM (`method: dflash`), SGLang (`--speculative-algorithm DFLASH`) and the reference `dflash` package load.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash.models.drafter import DFlashDraftModel
from dflash.models.drafter_config import DrafterConfig
from dflash.models.targets.chat_template import TEMPLATE_FILE
from dflash.config.errors import CorruptFile
from dflash.run_files import checksum_problem, settle_swap, swap_in_dir, temp_path, write_checksums

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
TENSOR_PREFIXES = ("layers.", "fc.", "hidden_norm.", "norm.")


def drafter_tensors(drafter: DFlashDraftModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of `drafter` in `dtype`; raises if the module holds anything else persistent."""
    state = drafter.state_dict()
    extra = sorted(name for name in state if not name.startswith(TENSOR_PREFIXES))
    if extra:
        raise ValueError(f"drafter has tensors outside {TENSOR_PREFIXES} that a z-lab checkpoint cannot hold: {extra}")
    return {name: tensor.detach().to(device="cpu", dtype=dtype).contiguous() for name, tensor in state.items()}


class NonFiniteWeights(ValueError):
    """A drafter with NaN or infinite weights: never exported, never evaluated."""


def refuse_non_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """NonFiniteWeights naming the tensors of `where` that hold NaN or infinite values (and how many)."""
    bad = [f"{name} ({int((~torch.isfinite(t)).sum())} of {t.numel()})" for name, t in sorted(tensors.items())
           if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise NonFiniteWeights(f"{where}: {len(bad)} tensor(s) hold NaN or infinite values: {_head(bad)}; the "
                               f"training that made them diverged (see its loss and grad_norm in metrics.jsonl)")


def export_zlab(drafter: DFlashDraftModel, out_dir: str, dtype: torch.dtype = torch.bfloat16,
                chat_template: str | None = None) -> str:
    """Write out_dir/config.json, out_dir/model.safetensors, with `chat_template` out_dir/chat_template.jinja (the
    template the drafter was trained with where the target's own is not it: a serving engine is given the file),
    and their checksums.json; an existing out_dir is replaced as a whole.

    Written into a temporary sibling folder first (`.<name>.tmp-<pid>`), then moved into place, so out_dir is never
    half-written; if the move fails, the previous export stays at out_dir. What an export killed midway left beside
    out_dir goes first, and where it was killed between its two renames the previous export comes back before
    anything else (settle_swap). The folder and files get the usual modes (0o777 / 0o666 less the umask), so other
    users can read an export as they can any file of the run. Returns out_dir.
    """
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    # Also the random names exports were written under before (mkdtemp's `.<name>.XXXXXXXX.tmp`: eight characters,
    # so that a sibling folder of a dotted name, `.<name>.v2.<random>.tmp`, is not taken for this one's).
    escaped = glob.escape(os.path.basename(out_dir))
    settle_swap(out_dir, legacy=(f".{escaped}.????????.tmp", f".{escaped}.????????.tmp.old"))
    config = drafter.config.to_zlab()
    config["dtype"] = str(dtype).removeprefix("torch.")
    tensors = drafter_tensors(drafter, dtype)
    refuse_non_finite(tensors, f"the drafter to export to {out_dir}")
    temp = temp_path(out_dir)
    shutil.rmtree(temp, ignore_errors=True)
    os.makedirs(temp)
    try:
        with open(os.path.join(temp, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        save_file(tensors, os.path.join(temp, WEIGHTS_NAME), metadata={"format": "pt"})
        if chat_template is not None:
            with open(os.path.join(temp, TEMPLATE_FILE), "w", encoding="utf-8") as f:
                f.write(chat_template)
        write_checksums(temp)  # verified by load_drafter
        # safetensors may write 0o600, which only the owner could read: the usual modes, set here.
        umask = process_umask()
        for name in os.listdir(temp):
            os.chmod(os.path.join(temp, name), 0o666 & ~umask)
        os.chmod(temp, 0o777 & ~umask)
        swap_in_dir(temp, out_dir, aside=temp + ".old")  # a failed swap leaves the previous export in place
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return out_dir


def process_umask() -> int:
    """The process umask, read without changing it where Linux shows it (os.umask can only read by setting, and
    another thread creating a file meanwhile would get the temporary mask)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    # Elsewhere: set a strict mask for the instant of the swap, so a racing thread errs toward private files.
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


def _weight_files(path: str) -> list[str]:
    single = os.path.join(path, WEIGHTS_NAME)
    if os.path.isfile(single):
        return [single]
    index = os.path.join(path, WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, shard) for shard in shards]
    raise FileNotFoundError(f"no {WEIGHTS_NAME} (or {WEIGHTS_INDEX_NAME}) in drafter folder {path}")


def _head(names: list[str], count: int = 10) -> str:
    return f"{names[:count]}{' ...' if len(names) > count else ''}"


def load_drafter(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DFlashDraftModel:
    """Build a DFlashDraftModel from a z-lab drafter folder (config.json + safetensors). CorruptFile when a file
    differs from the folder's checksums.json (an export of ours; a folder without one is loaded unchecked)."""
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"drafter folder not found: {path}")
    problem = checksum_problem(path)
    if problem is not None:
        raise CorruptFile(f"drafter folder {path} is corrupt: {problem}")
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no {CONFIG_NAME} in drafter folder {path}")
    with open(config_path) as f:
        config = DrafterConfig.from_zlab(json.load(f))
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    drafter = DFlashDraftModel(config)
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"drafter weights in {path} do not match its config.json: missing {_head(missing)}, "
            f"unexpected {_head(unexpected)}"
        )
    wrong = [f"{n}: {tuple(tensors[n].shape)} != {tuple(t.shape)}" for n, t in expected.items()
             if tensors[n].shape != t.shape]
    if wrong:
        raise ValueError(f"drafter weights in {path} have wrong shapes for its config.json: {wrong[:10]}")
    refuse_non_finite(tensors, f"drafter weights in {path}")
    drafter.load_state_dict(tensors)
    drafter.to(device=device, dtype=dtype)
    return drafter.eval()
