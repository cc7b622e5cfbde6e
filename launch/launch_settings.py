"""The composed config's settings the launchers need, printed as shell assignments (one config composition for all
of them): `eval "$(python launch/launch_settings.py OVERRIDES...)"` in launch/one_node.sh and launch/multi_node.sh.
A setting they cannot run with (an override Hydra cannot compose, a device list with a GPU twice or a negative id)
ends them here in one line, exit status 2, as the commands end.
shared_gpus_problem: why capture=online's device lists cannot run as one node's job (one_node.sh refuses with it
where it runs that job), empty when they can."""

import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omegaconf import OmegaConf  # noqa: E402

from dflash.config import ConfigError, compose  # noqa: E402
from dflash.config.composition_errors import refuse_uncomposable  # noqa: E402
from dflash.config.schema import check_gpu_list  # noqa: E402


def gpus_per_worker(setting: object, target: dict, num_devices: int) -> int:
    """placement.resolve_gpus_per_worker, which imports torch and the target code (~5 s) only where it is needed:
    for "auto" (it asks the GPUs) and for a count it refuses. A count that divides the capture GPUs is itself."""
    if str(setting).isdigit() and int(str(setting)) >= 1 and num_devices % int(str(setting)) == 0:
        return int(str(setting))
    from dflash.models.targets.placement import resolve_gpus_per_worker

    try:
        return resolve_gpus_per_worker(setting, target, num_devices)
    except ValueError as error:  # a count that does not divide the capture GPUs: one line, not a traceback
        raise ConfigError(str(error)) from None


def composed(overrides: list[str]):
    """compose(overrides); where Hydra cannot compose them, the one line `python -m dflash.train` ends with
    (composition_errors.refuse_uncomposable composes them again to name the override and what it takes)."""
    try:
        return compose(overrides)
    except ConfigError:
        raise
    except Exception:
        if os.environ.get("HYDRA_FULL_ERROR") != "1":  # as the commands do: Hydra's own error when asked for
            refuse_uncomposable(overrides, "train")
        raise


def device_list(key: str, node: object) -> str:
    """The GPUs of a device list as CUDA_VISIBLE_DEVICES lists them, "" where it is not set; ConfigError where the
    schema refuses the list (a GPU twice, a negative id: schema.check_gpu_list)."""
    if node is None:
        return ""
    check_gpu_list(key, node)
    return ",".join(str(d) for d in node)


def launch_settings(overrides: list[str]) -> dict[str, object]:
    cfg = composed(overrides)
    capture = device_list("capture.devices", cfg.capture.devices)
    train = device_list("train.devices", cfg.train.devices)
    setting = cfg.capture.get("gpus_per_worker", 1) if str(cfg.capture.mode) != "colocated" else 1
    per_node = cfg.capture.get("ranks_per_node")
    # Unlisted capture GPUs: GPUs 0 .. of one worker, or of every node's capture ranks (capture.ranks_per_node).
    unlisted = (per_node or 1) * (int(str(setting)) if str(setting).isdigit() else 1)
    gpus = gpus_per_worker(setting, OmegaConf.to_container(cfg.target, resolve=True),
                           len(capture.split(",")) if capture else unlisted)
    capture = capture or ",".join(str(d) for d in range(unlisted))
    settings = {"capture_devices": capture, "train_devices": train or "0",
                "capture_mode": str(cfg.capture.mode), "gpus_per_worker": gpus, "ranks_per_node": per_node or ""}
    online = settings["capture_mode"] == "online"
    settings["shared_gpus_problem"] = (shared_gpus_problem(settings["train_devices"], settings["capture_devices"],
                                                           str(cfg.device)) if online else "")
    return settings


def shared_gpus_problem(train: str, capture: str, device: str) -> str:
    """Why capture=online's trainer and capture ranks, which run at once with a GPU each, cannot run as one node's
    job on these lists: they share a GPU (CUDA_VISIBLE_DEVICES would list it twice; train.devices defaults to [0],
    capture.devices to GPUs 0 .. of one worker). Empty when they share none, or on the CPU (device=cpu, or auto
    without a GPU)."""
    shared = sorted(set(train.split(",")) & set(capture.split(",")), key=int)
    if not shared or device == "cpu":
        return ""
    if device == "auto":
        import torch

        if not torch.cuda.is_available():
            return ""
    # As many GPUs as capture lists, none of the trainers': what a capture worker of several GPUs needs too.
    free = [str(g) for g in range(1024) if str(g) not in train.split(",")][:len(capture.split(","))]
    return (f"capture=online runs its trainer and capture ranks at once, one GPU each, but train.devices=[{train}] "
            f"and capture.devices=[{capture}] share GPU {', '.join(shared)} (an unlisted one starts at GPU 0): list "
            f"GPUs of their own, e.g. train.devices=[{train}] capture.devices=[{','.join(free)}]")


if __name__ == "__main__":
    try:
        settings = launch_settings(sys.argv[1:])
    except ConfigError as error:  # one line, as the commands print it
        print(f"dflash: error: {error}", file=sys.stderr)
        sys.exit(2)
    for key, value in settings.items():
        print(f"{key}={shlex.quote(str(value))}")
