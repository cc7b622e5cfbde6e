"""train.profile_steps: a torch.profiler table of a few real training steps (rank 0).

The benchmark (bench/train_step.py) times the step on random features; a real run adds the batch preparation, the
colocated target forward or the feature reads, and the logging around it. Profiling optimizer steps
[start, start + count) of the real loop shows where that time goes. The table (device time first on CUDA) is
written next to the checkpoints folder as train_profile.txt.
"""

from __future__ import annotations


import torch
from torch.profiler import ProfilerActivity, profile

from dflash.run_files import write_text


def parse_profile_steps(spec: str | None) -> tuple[int, int] | None:
    """"START:COUNT" (steps counted from 1) as (start, count); None stays None."""
    if spec is None or str(spec).strip() in ("", "null", "None"):
        return None
    try:
        start, count = (int(part) for part in str(spec).split(":"))
    except ValueError:
        raise ValueError(f"train.profile_steps={spec!r}: expected START:COUNT, e.g. 100:5") from None
    if start < 1 or count < 1:
        raise ValueError(f"train.profile_steps={spec!r}: START and COUNT must be >= 1")
    return start, count


class StepProfiler:
    """Profiles optimizer steps start .. start + count - 1 of one process; a no-op without a spec or off rank 0."""

    def __init__(self, spec: str | None, path: str, device: torch.device, enabled: bool = True) -> None:
        self.window = parse_profile_steps(spec) if enabled else None
        self.path, self.device = path, torch.device(device)
        self._profile: profile | None = None
        self._first = 0

    def before_step(self, step: int) -> None:
        """Call with the number of the step about to run (1-based); a run resumed inside the window starts there."""
        if self.window is None or self._profile is not None:
            return
        start, count = self.window
        if start <= step < start + count:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._profile = profile(activities=activities)
            self._profile.__enter__()
            self._first = step

    def after_step(self, step: int) -> None:
        """Call with the number of the step that just ended; the last profiled one writes the table."""
        if self._profile is not None and step >= self.window[0] + self.window[1] - 1:
            self.close(step)

    def close(self, last_step: int) -> None:
        """Stop and write what was recorded (a run that ends or stops inside the window); no-op when not running.
        Call it when the loop ends, however it ends: a profiler left running would record the rest of the process."""
        if self._profile is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._profile.__exit__(None, None, None)
        key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self._profile.key_averages().table(sort_by=key, row_limit=80, max_name_column_width=90)
        self._profile = None
        first, count = self._first, last_step - self._first + 1
        write_text(self.path, f"optimizer steps {first}..{last_step} of the training loop ({count} steps)\n{table}")
        print(f"[train] profile of steps {first}..{last_step} -> {self.path}", flush=True)
