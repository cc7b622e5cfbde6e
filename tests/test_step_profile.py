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
    ms, operators, launches, waits, waiting = forward[len(PHASE_FORWARD):].split()
    assert float(ms) > 0 and int(operators) > 20 and int(launches) == 0  # no kernel launches on the CPU
    assert float(waits) == 0 and float(waiting) == 0  # nor waits for a GPU
    assert "the GPU busy" not in text  # the wall-against-GPU line is CUDA's
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


def profiler_event(name, start, end, device=None, thread=1, annotation=False):
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    return FunctionEvent(id=0, name=name, thread=thread, start_us=start, end_us=end,
                         device_type=DeviceType.CPU if device is None else device, is_user_annotation=annotation)


def test_the_phase_table_counts_host_events_only():
    """On CUDA a range also appears as a GPU-side annotation of the same name on the GPU's (late) timeline; it
    must add neither time nor the host's later operators and launches to the phase."""
    from torch.autograd import DeviceType

    from dflash.train.step_profile import phase_table

    events = [
        profiler_event(PHASE_FORWARD, 0, 1000), profiler_event("aten::mm", 100, 200),
        profiler_event("cudaLaunchKernel", 120, 130),
        profiler_event(PHASE_BACKWARD, 1000, 3000), profiler_event("aten::mm", 1500, 1600),
        profiler_event("cudaLaunchKernel", 1520, 1530),
        profiler_event("aten::mm", 2500, 2600), profiler_event("cudaLaunchKernel", 2520, 2530),
        profiler_event(PHASE_FORWARD, 1200, 5200, device=DeviceType.CUDA, thread=7),  # the GPU runs the forward late
        profiler_event("void gemm_kernel", 1300, 5100, device=DeviceType.CUDA, thread=7),
    ]
    lines = phase_table(events, 1).splitlines()
    forward = next(line for line in lines if line.startswith(PHASE_FORWARD))
    backward = next(line for line in lines if line.startswith(PHASE_BACKWARD))
    assert forward.split()[-5:] == ["1.0", "1", "1", "0", "0.0"]
    assert backward.split()[-5:] == ["2.0", "2", "2", "0", "0.0"]
    # and which operators each phase calls most, per step
    assert f"{PHASE_BACKWARD}: aten::mm 2" in lines and f"{PHASE_FORWARD}: aten::mm 1" in lines


def test_the_host_waits_for_the_gpu_are_counted_by_phase_and_by_the_operator_that_waited():
    """A synchronising CUDA call (a copy to the host ends in one) is a wait: counted in its phase with its time, and
    by the outermost operator of its own thread that made it; one outside any operator counts as "-"."""
    from dflash.train.step_profile import phase_table, waits_by_operator

    events = [
        profiler_event(PHASE_FORWARD, 0, 1000),
        profiler_event("aten::item", 100, 400), profiler_event("aten::_local_scalar_dense", 110, 390),
        profiler_event("cudaMemcpyAsync", 120, 130), profiler_event("cudaStreamSynchronize", 130, 380),
        profiler_event("aten::item", 500, 700), profiler_event("cudaStreamSynchronize", 510, 690),
        profiler_event("aten::mm", 520, 600, thread=2),  # another thread's operator does not own the wait
        profiler_event(PHASE_BACKWARD, 1000, 3000), profiler_event("cudaDeviceSynchronize", 1100, 2100),
        profiler_event("cudaLaunchKernel", 2200, 2210),  # a launch is no wait
    ]
    lines = phase_table(events, 2).splitlines()
    # per step over 2 steps: the forward's two waits of 0.25 and 0.18 ms, the backward's one of 1 ms
    assert next(line for line in lines if line.startswith(PHASE_FORWARD)).split()[-2:] == ["1", "0.2"]
    assert next(line for line in lines if line.startswith(PHASE_BACKWARD)).split()[-2:] == ["0.5", "0.5"]
    assert waits_by_operator(events) == {"aten::item": 2, "-": 1}
    called = next(line for line in lines if line.startswith(f"{PHASE_FORWARD}: "))
    assert called == f"{PHASE_FORWARD}: aten::item 1, aten::mm 0.5"  # what runs inside aten::item is part of it


def test_the_gpu_busy_time_is_the_union_of_its_activities_without_the_ranges():
    from torch.autograd import DeviceType

    from dflash.train.step_profile import bound_summary, busy_ms

    cuda = DeviceType.CUDA
    events = [
        profiler_event("void gemm_kernel", 0, 1000, cuda, thread=7),
        profiler_event("triton_fused_norm", 500, 1500, cuda, thread=8),  # another stream, overlapping: counted once
        profiler_event("Memcpy HtoD", 3000, 3500, cuda, thread=7),
        profiler_event(PHASE_FORWARD, 0, 9000, cuda, thread=7),  # the GPU side of dflash's range: not a kernel
        profiler_event("ProfilerStep", 0, 9000, cuda, thread=7, annotation=True),  # nor any other annotation
        profiler_event("aten::item", 2000, 2600), profiler_event("cudaStreamSynchronize", 2010, 2590),
    ]
    assert busy_ms(events) == 2.0
    assert busy_ms(events + [profiler_event("void gemm_kernel", 5000, 8000, cuda, thread=9)]) == 5.0
    other_gpu = profiler_event("void gemm_kernel", 5000, 8000, cuda, thread=9)
    other_gpu.device_index = 1
    assert busy_ms(events + [other_gpu]) == 2.0 and busy_ms(events + [other_gpu], device_index=1) == 3.0
    host_bound = bound_summary(events, wall_ms=8.0, steps=2)
    assert "4.0 ms of wall time" in host_bound and "the GPU busy 1.0 ms of it (25%)" in host_bound
    assert "the GPU idles 3.0 ms a step: bound by the host" in host_bound
    assert "the host's waits for the GPU, per step: 0.5 (aten::item 0.5)" in host_bound
    assert "bound by the GPU" in bound_summary(events, wall_ms=2.1, steps=1)


@pytest.mark.gpu
def test_on_cuda_the_table_opens_with_the_busy_time_and_names_the_operator_that_waited(tmp_path):
    """The CUDA runtime's own names and threads: a step that reads a value back (.item()) waits in aten::item."""
    path = tmp_path / "train_profile.txt"
    profiler = StepProfiler("1:2", str(path), torch.device("cuda"))
    x = torch.randn(1024, 1024, device="cuda")
    (x @ x).sum().item()  # cuBLAS's setup and the first pinned buffer before the window, not in it
    for step in (1, 2):
        profiler.before_step(step)
        (x @ x).sum().item()
        profiler.after_step(step)
    text = path.read_text()
    assert "ms of wall time" in text and "the GPU busy" in text
    assert "the host's waits for the GPU, per step: 1 (aten::item 1)" in text


def test_the_profilers_own_synchronisations_at_the_end_of_the_window_are_not_waits():
    from dflash.train.step_profile import WINDOW_END, waits_by_operator

    events = [profiler_event("aten::item", 100, 400), profiler_event("cudaStreamSynchronize", 130, 380),
              profiler_event(WINDOW_END, 500, 501),
              profiler_event("cudaDeviceSynchronize", 510, 900), profiler_event("cudaDeviceSynchronize", 950, 990)]
    assert waits_by_operator(events) == {"aten::item": 1}
    assert waits_by_operator(events[:2] + events[3:]) == {"aten::item": 1, "-": 2}  # no end marked: all count
