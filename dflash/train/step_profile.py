"""train.profile_steps: a torch.profiler table of a few real training steps (rank 0).

The benchmark (bench/train_step.py) times the step on random features; a real run adds the batch preparation, the
colocated target forward or the feature reads, and the logging around it. Profiling optimizer steps
[start, start + count) of the real loop shows where that time goes. The table (device time first on CUDA) is
written next to the checkpoints folder as train_profile.txt. On CUDA it opens with the step's wall time against the
time the GPU was busy, which says whether the host or the GPU bounds the step, and with the host's waits for the GPU
(synchronising CUDA calls, by the operator that made them): a wait stops the host from running ahead of the GPU.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from dflash.run_files import write_text

logger = logging.getLogger(__name__)

# dflash's own profiler ranges (record_function) start with this: the step's phases (loop.PHASE_*) and the
# colocated target forward inside the batches phase.
PHASE_PREFIX = "dflash: "
MOST_CALLED = 8  # operators listed per phase
# CUDA runtime calls that return only when the GPU has caught up (a copy to the host ends in a stream synchronize).
# Counted, each wait is; timed, a copy into pageable memory (.cpu(), .tolist()) waits inside its cudaMemcpyAsync
# already, so its synchronize is short and the table's ms understate that wait.
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
# Recorded as the window closes, before the profiler's own synchronisations, which are not the step's waits.
WINDOW_END = "dflash profiler: end of the window"
# Below this share of the step's wall time spent in kernels, the GPU waits on the host.
GPU_BOUND_SHARE = 0.9


def profile_path(checkpoint_dir: str) -> str:
    """Where the table goes: train_profile.txt next to the checkpoints folder (in the run folder)."""
    return os.path.join(os.path.dirname(os.path.abspath(checkpoint_dir)), "train_profile.txt")


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


def in_window(window: tuple[int, int] | None, step: int) -> bool:
    """Whether optimizer step `step` (1-based) is one of the window's (parse_profile_steps; None: no window)."""
    return window is not None and window[0] <= step < window[0] + window[1]


class StepProfiler:
    """Profiles optimizer steps start .. start + count - 1 of one process; records nothing without a spec or when not
    enabled (off rank 0)."""

    def __init__(self, spec: str | None, path: str, device: torch.device, enabled: bool = True) -> None:
        self.window = parse_profile_steps(spec)  # on every rank: profiles() answers the same everywhere
        self.enabled = enabled
        self.path, self.device = path, torch.device(device)
        self._profile: profile | None = None
        self._first = 0
        self._started = 0.0

    def profiles(self, step: int) -> bool:
        """Whether step `step` (1-based) is in the window, on every rank (a profiled step is slower than the rest)."""
        return in_window(self.window, step)

    def before_step(self, step: int) -> None:
        """Call with the number of the step about to run (1-based); a run resumed inside the window starts there."""
        if not self.enabled or self.window is None or self._profile is not None:
            return
        if in_window(self.window, step):
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._profile = profile(activities=activities)
            self._profile.__enter__()
            self._first = step
            self._started = time.perf_counter()

    def after_step(self, step: int) -> None:
        """Call with the number of the step that just ended; the last profiled one writes the table."""
        if self._profile is not None and step >= self.window[0] + self.window[1] - 1:
            self.close(step)

    def close(self, last_step: int) -> None:
        """Stop and write what was recorded (a run that ends or stops inside the window); no-op when not running.
        Call it when the loop ends, however it ends: a profiler left running would record the rest of the process."""
        if self._profile is None:
            return
        with record_function(WINDOW_END):
            pass
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall_ms = (time.perf_counter() - self._started) * 1000
        self._profile.__exit__(None, None, None)
        averages, events = self._profile.key_averages(), self._profile.events()
        first, count = self._first, last_step - self._first + 1
        phases = phase_table(events, count)
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            phases = f"{bound_summary(events, wall_ms, count, index)}\n{phases}"
        self._profile = None
        key = self_time_key(self.device)
        text = (f"optimizer steps {first}..{last_step} of the training loop ({count} steps)\n\n{phases}\n"
                f"operators by {'GPU' if self.device.type == 'cuda' else 'host'} time of their own:\n"
                + averages.table(sort_by=key, row_limit=80, max_name_column_width=90))
        write_text(self.path, text)
        logger.info(f"[train] profile of steps {first}..{last_step} -> {self.path}")


def self_time_key(device: torch.device) -> str:
    """What a profiler table is sorted by: each operator's own device time on CUDA, its own host time elsewhere (a
    kernel's time counted once, not again in every operator above it)."""
    return "self_device_time_total" if torch.device(device).type == "cuda" else "self_cpu_time_total"


@dataclass
class PhaseCount:
    """One of dflash's named ranges, summed over its occurrences: host milliseconds, operators called (the outermost
    aten calls: an aten op inside another one is part of its caller) and GPU kernels launched, and which operators."""

    host_ms: float = 0.0
    operators: int = 0
    launches: int = 0
    waits: int = 0
    wait_ms: float = 0.0
    called: Counter = field(default_factory=Counter)


def phase_counts(events) -> dict[str, PhaseCount]:
    """Each of dflash's named ranges (PHASE_PREFIX) among a profiler's `events`, with what ran inside it.

    An event counts for a range when it starts inside it on any thread: autograd runs a CUDA backward on its own
    threads."""
    # Host events only: on CUDA each range also appears as a GPU-side annotation of the same name, timed on the
    # GPU's timeline, which would count the GPU's lag behind the host as host time.
    host = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    ranges = sorted((e.time_range.start, e.time_range.end, e.name) for e in host if e.name.startswith(PHASE_PREFIX))
    outermost = sorted((start, name) for spans in outermost_operators(host).values() for start, _, name in spans)
    operators = [start for start, _ in outermost]
    launches = sorted(e.time_range.start for e in host if "LaunchKernel" in e.name)
    waits = sorted((e.time_range.start, e.time_range.end) for e in host if e.name in HOST_WAITS)
    wait_starts = [start for start, _ in waits]
    counts: dict[str, PhaseCount] = {}
    for start, end, name in ranges:
        count = counts.setdefault(name, PhaseCount())
        first, last = bisect.bisect_left(operators, start), bisect.bisect_left(operators, end)
        count.host_ms += (end - start) / 1000
        count.operators += last - first
        count.launches += bisect.bisect_left(launches, end) - bisect.bisect_left(launches, start)
        inside = waits[bisect.bisect_left(wait_starts, start):bisect.bisect_left(wait_starts, end)]
        count.waits += len(inside)
        count.wait_ms += sum(wait_end - wait_start for wait_start, wait_end in inside) / 1000
        count.called.update(op for _, op in outermost[first:last])
    return counts


def busy_ms(events, device_index: int = 0) -> float:
    """Milliseconds in which GPU `device_index` ran at least one kernel, copy or fill: the union of its activities'
    intervals (kernels of several streams overlap), without the ranges (dflash's and others') its timeline shows."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA
                   and e.device_index == device_index and not e.name.startswith(PHASE_PREFIX)
                   and not getattr(e, "is_user_annotation", False))
    busy, reach = 0, None
    for start, end in spans:
        if reach is None or start > reach:
            busy, reach = busy + end - start, end
        elif end > reach:
            busy, reach = busy + end - reach, end
    return busy / 1000


def outermost_operators(host) -> dict[int, list[tuple[int, int, str]]]:
    """The aten operators among host events that no other aten operator of their thread contains (an operator
    inside another one is part of it), per thread, as (start, end, name) sorted by start."""
    nested: dict[int, list[tuple[int, int, str]]] = {}
    for e in host:
        if e.name.startswith("aten::"):
            nested.setdefault(e.thread, []).append((e.time_range.start, -e.time_range.end, e.name))
    operators: dict[int, list[tuple[int, int, str]]] = {}
    for thread, spans in nested.items():
        kept = operators.setdefault(thread, [])
        for start, minus_end, name in sorted(spans):
            if not kept or start >= kept[-1][1]:
                kept.append((start, -minus_end, name))
    return operators


def waits_by_operator(events) -> Counter:
    """The host's waits for the GPU (HOST_WAITS) before WINDOW_END, counted by the outermost aten operator of the
    same thread that made them ("-" outside any operator)."""
    host = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    end = min((e.time_range.start for e in host if e.name == WINDOW_END), default=float("inf"))
    operators = outermost_operators(host)
    found: Counter = Counter()
    for e in host:
        if e.name not in HOST_WAITS or e.time_range.start >= end:
            continue
        spans = operators.get(e.thread, [])
        index = bisect.bisect_right(spans, (e.time_range.start, float("inf"), "")) - 1
        inside = index >= 0 and spans[index][1] >= e.time_range.end
        found[spans[index][2] if inside else "-"] += 1
    return found


def bound_summary(events, wall_ms: float, steps: int, device_index: int = 0) -> str:
    """Per step: the wall time under the profiler, GPU `device_index`'s busy time, which of the two bounds the step,
    and the host's waits for the GPU by operator."""
    busy = busy_ms(events, device_index)
    share = busy / wall_ms if wall_ms > 0 else 0.0
    verdict = ("bound by the GPU" if share >= GPU_BOUND_SHARE else
               f"the GPU idles {(wall_ms - busy) / steps:.1f} ms a step: bound by the host")
    waits = waits_by_operator(events)
    by_operator = ", ".join(f"{op} {count / steps:.3g}" for op, count in waits.most_common(MOST_CALLED))
    return (f"per step: {wall_ms / steps:.1f} ms of wall time (the profiler slows the host; compare step_s in "
            f"metrics.jsonl), the GPU busy {busy / steps:.1f} ms of it ({share:.0%}): {verdict}\n"
            f"the host's waits for the GPU, per step: {sum(waits.values()) / steps:.3g}"
            + (f" ({by_operator})" if by_operator else "") + "\n")


def phase_table(events, steps: int) -> str:
    """Per step, for each of dflash's named ranges: host ms, operators called, GPU kernels launched, waits, waiting ms.

    When the host is the bound (a small drafter, a colocated target), the step takes as long as the host needs
    to issue it, so operators and launches per phase say where the time goes on any machine (phase_counts).
    """
    counts = phase_counts(events)
    width = max([len(name) for name in counts] + [5])
    order = sorted(counts, key=lambda name: -counts[name].host_ms)
    lines = [f"the step's phases, per step ({steps} steps; nested ranges count in each):",
             f"{'phase':<{width}}  {'host ms':>9}  {'operators':>9}  {'kernel launches':>15}  {'waits':>5}  "
             f"{'waiting ms':>10}"]
    for name in order:
        c = counts[name]
        lines.append(f"{name:<{width}}  {c.host_ms / steps:9.1f}  {c.operators / steps:9.0f}  "
                     f"{c.launches / steps:15.0f}  {c.waits / steps:5.3g}  {c.wait_ms / steps:10.1f}")
    # Which operators a phase calls most: a count that grows with the parameters or the sequences is a loop to fuse.
    lines.append("\nthe operators each phase calls most, per step:")
    for name in order:
        common = ", ".join(f"{op} {count / steps:.3g}" for op, count in counts[name].called.most_common(MOST_CALLED))
        lines.append(f"{name}: {common or '-'}")
    return "\n".join(lines) + "\n"
