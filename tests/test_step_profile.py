"""train.profile_steps: a profiler table of chosen steps of the real training loop."""

import pytest
import torch

from dflash.config import compose
from dflash.pipeline import run_command
from dflash.train.loop import (PHASE_BACKWARD, PHASE_BATCHES, PHASE_FORWARD, PHASE_LOSS, PHASE_METRICS,
                               PHASE_OPTIMIZER)
from dflash.train.step_profile import StepProfiler, parse_profile_steps
from tests.forked import run_ranks


def test_the_window_is_parsed_or_named_as_wrong():
    assert parse_profile_steps(None) is None and parse_profile_steps("10:5") == (10, 5)
    for bad in ("10", "a:b", "0:3", "3:0"):
        with pytest.raises(ValueError, match="train.profile_steps"):
            parse_profile_steps(bad)


def test_only_the_window_is_profiled_and_written_once(tmp_path):
    path = tmp_path / "train_profile.txt"
    profiler = StepProfiler("2:2", str(path), torch.device("cpu"))
    for step in range(1, 6):
        profiler.before_step(step)
        torch.ones(64, 64) @ torch.ones(64, 64)
        profiler.after_step(step)
        assert path.exists() == (step >= 3)
    assert path.read_text().startswith("optimizer steps 2..3") and "aten::mm" in path.read_text()
    silent = StepProfiler("1:1", str(tmp_path / "other.txt"), torch.device("cpu"), enabled=False)  # not rank 0
    silent.before_step(1), silent.after_step(1)
    assert not (tmp_path / "other.txt").exists()


def profiled_run(run_dir: str) -> None:
    """The run of the test below, in the process of its own that it needs."""
    run_command(compose(["+experiment=tiny", "show_progress=false", f"run_dir={run_dir}", "train.max_steps=3",
                         "train.profile_steps=2:2", "stages=[data,capture,train]"]))


def test_a_run_writes_its_profile_next_to_the_checkpoints(tmp_path):
    # A fresh process (tests/forked.py): which aten operators the profiler sees as outermost depends on dispatch state
    # that earlier tests of the same process can leave behind (in the full suite aten::linear went missing).
    assert run_ranks(profiled_run, 1, str(tmp_path)) == [0]
    text = (tmp_path / "train_profile.txt").read_text()
    assert text.startswith("optimizer steps 2..3")
    phases = text.split("the step's phases")[1].split("operators by host time")[0]
    forward = next(line for line in phases.splitlines() if line.startswith(PHASE_FORWARD))
    ms, operators, launches = forward[len(PHASE_FORWARD):].split()
    assert float(ms) > 0 and int(operators) > 20 and int(launches) == 0  # no kernel launches on the CPU
    for phase in (PHASE_BATCHES, PHASE_FORWARD, PHASE_LOSS, PHASE_BACKWARD, PHASE_OPTIMIZER, PHASE_METRICS):
        assert phase in phases  # each phase of the step is a row of the host-time table
    most_called = phases.split("the operators each phase calls most")[1]
    assert "aten::linear" in next(line for line in most_called.splitlines() if line.startswith(PHASE_FORWARD))


def test_a_run_that_ends_inside_the_window_still_stops_the_profiler_and_writes(tmp_path):
    path = tmp_path / "train_profile.txt"
    profiler = StepProfiler("2:10", str(path), torch.device("cpu"))
    for step in range(4, 6):  # resumed at step 4, inside the window: profiled from there
        profiler.before_step(step)
        torch.ones(8) + 1
        profiler.after_step(step)
    assert not path.exists()
    profiler.close(5)  # the loop ended (last step, a signal, an error) before the window did
    assert path.read_text().startswith("optimizer steps 4..5")
    profiler.close(5)  # closing twice is harmless


def test_the_phase_table_counts_host_events_only():
    """On CUDA a range also appears as a GPU-side annotation of the same name on the GPU's (late) timeline; it
    must add neither time nor the host's later operators and launches to the phase."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from dflash.train.step_profile import phase_table

    def event(name, start, end, device=DeviceType.CPU, thread=1):
        return FunctionEvent(id=0, name=name, thread=thread, start_us=start, end_us=end, device_type=device)

    events = [
        event(PHASE_FORWARD, 0, 1000), event("aten::mm", 100, 200), event("cudaLaunchKernel", 120, 130),
        event(PHASE_BACKWARD, 1000, 3000), event("aten::mm", 1500, 1600), event("cudaLaunchKernel", 1520, 1530),
        event("aten::mm", 2500, 2600), event("cudaLaunchKernel", 2520, 2530),
        event(PHASE_FORWARD, 1200, 5200, device=DeviceType.CUDA, thread=7),  # the GPU runs the forward late
        event("void gemm_kernel", 1300, 5100, device=DeviceType.CUDA, thread=7),
    ]
    lines = phase_table(events, 1).splitlines()
    assert next(line for line in lines if line.startswith(PHASE_FORWARD)).split()[-3:] == ["1.0", "1", "1"]
    assert next(line for line in lines if line.startswith(PHASE_BACKWARD)).split()[-3:] == ["2.0", "2", "2"]
    # and which operators each phase calls most, per step
    assert f"{PHASE_BACKWARD}: aten::mm 2" in lines and f"{PHASE_FORWARD}: aten::mm 1" in lines
