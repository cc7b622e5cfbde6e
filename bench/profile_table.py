"""The torch.profiler table of a few calls, as bench/capture.py and bench/train_step.py write it.

Sorted by each operator's own time on the device (CUDA) or the host (CPU): a kernel's time is counted once, not
again in every operator above it. (dflash/train/step_profile.py writes the same kind of table for the real loop.)
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from dflash.run_files import write_text
from dflash.train.step_profile import self_time_key


def profile_calls(run: Callable[[], object], device: torch.device, calls: int = 1):
    """torch.profiler key_averages() of `calls` calls of `run`, with the device's kernels on CUDA. The device is
    synchronised before and after, so the calls' kernels and only theirs are recorded."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(calls):
            run()
        if cuda:
            torch.cuda.synchronize(device)
    return prof.key_averages()


def write_table(path: str, events, device: torch.device, title: str) -> None:
    """Write `title` and the table of `events` (profile_calls) to `path` atomically, making its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    table = events.table(sort_by=self_time_key(device), row_limit=60, max_name_column_width=100)
    write_text(path, f"{title}\n{table}")
