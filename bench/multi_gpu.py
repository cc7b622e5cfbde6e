"""Issue 22's multi-GPU run, in four parts that each fit one device call of 10 minutes; results under --out.

    python bench/multi_gpu.py --part 1 --zero 1,2 --out /tmp/mg   # trainer scaling, ZeRO-1 and ZeRO-2
    python bench/multi_gpu.py --part 1 --zero 3 --out /tmp/mg     # trainer scaling, ZeRO-3
    python bench/multi_gpu.py --part 2 --out /tmp/mg              # the Qwen3.6-27B layout, random weights
    python bench/multi_gpu.py --part 3 --out /tmp/mg              # the SmolLM2 recipe on every GPU (rerun: resumes)
    python bench/multi_gpu.py --part 4 --out /tmp/mg              # SIGKILL a trainer / capture rank, torchrun restart
    python bench/multi_gpu.py --dry-run --gpus 8 --out /tmp/mg    # print every part's commands, run nothing

--gpus N: GPUs used (default: every visible one). Each command runs with a time cap (its own, and never past
--budget seconds since the start of this call, default 540; a command past its cap gets SIGTERM, then SIGKILL
30 s later), its console going to <out>/part<P>/<name>.log; each part
writes <out>/part<P>/summary.json.
  1. bench/train_step.py --only flex (the Qwen3.6-27B drafter step, random weights and features) under torchrun on
     1, 2 and N-2 trainer GPUs (N when N <= 2: 1 and 2 only) for each ZeRO stage of --zero: tokens/s per GPU
     (sequence tokens of a step / the slowest rank's median step time) and its ratio to one GPU of the same stage.
  2. The Qwen3.6-27B layout as far as the benches go (no target folder: random weights): bench/capture.py
     --capture-only on GPU 0 and GPU 1 (one 27B target each) at the same time as bench/train_step.py's ZeRO-2 step on
     GPUs 2..N-1, nvidia-smi sampling memory per GPU meanwhile; then bench/feature_transport.py at the 5 x 5120 shape
     (gloo, host memory). The summary has capture tokens/s per GPU, trainer tokens/s per rank, the memory of each
     role and the capture:trainer split of N GPUs that balances the two rates. The time trainers wait for features
     needs the pipeline with a real target folder (capture=online), which this part does not run.
  3. launch/one_node.sh +experiment=smollm2 with train.devices = every GPU (colocated capture: each trainer rank runs
     the target), run folder --work/smollm2, train.max_minutes from --smollm2-minutes; the summary copies its
     metrics and eval summaries. The recipe (data stage, 16.5 min of training, eval) is longer than one call: on a
     warm machine the same command (the same --smollm2-minutes) resumes where the cut left it.
  4. tests/online_ranks_child.py (the CPU test's child) on GPUs: +experiment=tiny capture=online with 2 capture
     ranks (GPUs 0-1) and min(4, N-2) trainer ranks (1 and 1 on 2 or 3 GPUs) under torchrun --max-restarts 1: an
     uninterrupted job, one
     whose trainer rank 0 SIGKILLs itself after its 7th backward and one whose first capture rank SIGKILLs itself
     after its 6th micro-batch sent. Passes when each killed job left its marker, exited 0, logged every step once
     and ended with the uninterrupted job's losses.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
QWEN36_TOKENS_PER_STEP = 4096  # bench/train_step.py FULL: one sequence of 4096 tokens per step (batch 1)


class Step:
    """One command of a part: its name (the log file's), environment additions, argv and time cap in seconds."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None, cap: int = 120,
                 background: bool = False) -> None:
        self.name, self.argv, self.env, self.cap, self.background = name, argv, env or {}, cap, background

    def line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        tail = "  &  # in the background" if self.background else ""
        argv = ["python" if arg == PY else arg for arg in self.argv]  # the same interpreter, shown by name
        return f"[{self.name}, cap {self.cap}s] " + (env + " " if env else "") + shlex.join(argv) + tail


def gpu_list(gpus: list[int]) -> str:
    return ",".join(map(str, gpus))


def torchrun(nproc: int, *argv: str, restarts: int | None = None) -> list[str]:
    extra = ["--max-restarts", str(restarts)] if restarts is not None else []
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *extra, *argv]


def trainer_counts(n: int) -> list[int]:
    return sorted({1, min(2, n), n - 2 if n > 4 else n})


def part1(n: int, zero: list[int], steps: int) -> list[Step]:
    return [Step(f"zero{z}-gpus{k}", torchrun(k, "bench/train_step.py", "--only", "flex", "--zero-stage", str(z),
                                              "--steps", str(steps), "--warmup", "3"),
                 {"CUDA_VISIBLE_DEVICES": gpu_list(list(range(k)))}, cap=150)
            for z in zero for k in trainer_counts(n)]


def part2(n: int, steps: int) -> list[Step]:
    trainers = list(range(2, n)) or [0]
    capture = [PY, "bench/capture.py", "--capture-only", "--tokens", "100000"]
    return [
        Step("gpu-memory", ["nvidia-smi", "--query-gpu=index,memory.used,memory.total,utilization.gpu",
                            "--format=csv", "-l", "2"], cap=420, background=True),
        Step("capture-gpu0", capture, {"CUDA_VISIBLE_DEVICES": "0"}, cap=420, background=True),
        Step("capture-gpu1", capture, {"CUDA_VISIBLE_DEVICES": "1"}, cap=420, background=True),
        Step("trainers-zero2", torchrun(len(trainers), "bench/train_step.py", "--only", "flex", "--zero-stage", "2",
                                        "--steps", str(steps), "--warmup", "3"),
             {"CUDA_VISIBLE_DEVICES": gpu_list(trainers)}, cap=420),
        Step("feature-transport", [PY, "bench/feature_transport.py", "--width", "25600", "--tokens", "1024",
                                   "--units", "40"], cap=120),
    ]


def part3(n: int, work: Path, minutes: float) -> list[Step]:
    every = gpu_list(list(range(n)))
    return [Step("smollm2", ["bash", "launch/one_node.sh", "+experiment=smollm2", f"train.devices=[{every}]",
                             "capture.devices=[0]", f"run_dir={work / 'smollm2'}", f"train.max_minutes={minutes}",
                             "show_progress=false", "logging.wandb.mode=disabled"], cap=500)]


def fault_layout(n: int) -> tuple[int, int]:
    """(capture ranks, trainer ranks) of part 4: the tiny experiment's global batch of 4 bounds the trainers."""
    captures = 2 if n >= 4 else 1
    return captures, max(1, min(4, n - captures))


def part4(n: int, work: Path) -> list[Step]:
    captures, trainers = fault_layout(n)
    steps = []
    for point in ("none", "trainer", "capture"):
        run_dir = work / f"fault-{point}"
        overrides = ["+experiment=tiny", "show_progress=false", "device=auto", "capture=online", f"run_dir={run_dir}",
                     "stages=[data,capture,train]", f"capture.ranks={captures}",
                     f"train.micro_batch_size={4 // trainers}", "train.save_every=2"]
        argv = torchrun(captures + trainers, "tests/online_ranks_child.py", point, *overrides, restarts=1)
        # Trainer ranks first, then the capture ranks, each rank seeing GPU LOCAL_RANK (as launch/one_node.sh sets).
        devices = list(range(captures, captures + trainers)) + list(range(captures))
        steps.append(Step(f"fault-{point}", argv, {"CUDA_VISIBLE_DEVICES": gpu_list(devices),
                                                   "OMP_NUM_THREADS": "1"}, cap=170))
    return steps


def plan(args: argparse.Namespace) -> dict[int, list[Step]]:
    n, work = args.gpus, Path(args.work)
    return {1: part1(n, args.zero, args.steps), 2: part2(n, args.steps), 3: part3(n, work, args.smollm2_minutes),
            4: part4(n, work)}


def results(log: str) -> list[dict]:
    return [json.loads(line.split("RESULT ", 1)[1]) for line in log.splitlines() if "RESULT {" in line]


def per_gpu_rate(found: list[dict]) -> float | None:
    """Tokens/s per GPU of a data-parallel step: each rank's sequence tokens over the slowest rank's step time."""
    if not found:
        return None
    slowest = max(r["step_ms"] for r in found)
    return found[0]["batch"] * QWEN36_TOKENS_PER_STEP / (slowest / 1e3)


def summarize(part: int, folder: Path, ran: dict[str, dict], args: argparse.Namespace) -> dict:
    logs = {name: (folder / f"{name}.log").read_text(errors="replace") if (folder / f"{name}.log").exists() else ""
            for name in ran}
    summary: dict = {"part": part, "gpus": args.gpus, "commands": ran}
    if part == 1:
        rows = []
        for name in ran:
            z, k = map(int, re.match(r"zero(\d+)-gpus(\d+)", name).groups())
            rate = per_gpu_rate(results(logs[name]))
            rows.append({"zero": z, "gpus": k, "tokens_per_s_per_gpu": rate and round(rate, 1)})
        for row in rows:
            one = next((r["tokens_per_s_per_gpu"] for r in rows if r["zero"] == row["zero"] and r["gpus"] == 1), None)
            row["ratio_to_one_gpu"] = round(row["tokens_per_s_per_gpu"] / one, 3) if one and row[
                "tokens_per_s_per_gpu"] else None
        summary["scaling"] = rows
    elif part == 2:
        capture, capture_memory = {}, {}
        for name in ("capture-gpu0", "capture-gpu1"):
            rates = re.findall(r"capture[^\n]*?: ([\d,]+) tok/s", logs.get(name, ""))
            capture[name] = float(rates[-1].replace(",", "")) if rates else None
            peaks = re.findall(r"capture[^\n]*peak memory ([\d.]+) GiB", logs.get(name, ""))
            capture_memory[name] = float(peaks[-1]) if peaks else None
        trainer = results(logs.get("trainers-zero2", ""))
        rate = per_gpu_rate(trainer)
        summary.update({"capture_tokens_per_s": capture, "capture_peak_gib": capture_memory,
                        "trainer_tokens_per_s_per_rank": rate and round(rate, 1),
                        "trainer_peak_gib": [r.get("peak_gib") for r in trainer]})
        rates = [r for r in capture.values() if r]
        if rates and rate:
            c = sum(rates) / len(rates)
            x = args.gpus * rate / (c + rate)  # capture GPUs x with x * c == (N - x) * trainer rate
            summary["balanced_capture_gpus"] = round(x, 2)
            summary["used_split"] = [2, args.gpus - 2]
        summary["feature_transport"] = [line for line in logs.get("feature-transport", "").splitlines()
                                        if "GB/s" in line]
    elif part == 3:
        run_dir = Path(args.work) / "smollm2"
        copied = folder / "run"
        kept = [run_dir / "metrics.jsonl", *run_dir.glob("**/summary.json"), *run_dir.glob("capture_logs/*.json")]
        for found in kept:
            if found.is_file():
                target = copied / found.relative_to(run_dir)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(found, target)
        summary["copied"] = sorted(str(p.relative_to(folder)) for p in copied.glob("**/*") if p.is_file())
    elif part == 4:
        curves = {}
        for point in ("none", "trainer", "capture"):
            metrics = Path(args.work) / f"fault-{point}" / "metrics.jsonl"
            records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
            curves[point] = [(r["step"], r["loss"]) for r in records]
            markers = sorted(p.name for p in (Path(args.work) / f"fault-{point}").glob("killed-*"))
            steps = [s for s, _ in curves[point]]
            summary[point] = {"markers": markers, "rc": ran[f"fault-{point}"]["rc"], "steps": len(steps),
                              "each_step_once": steps == list(range(1, len(steps) + 1))}
        for point in ("trainer", "capture"):
            same = bool(curves[point]) and curves[point] == curves["none"]
            gap = max((abs(a[1] - b[1]) for a, b in zip(curves[point], curves["none"])), default=None)
            summary[point].update({"losses_equal_uninterrupted": same, "max_loss_difference": gap,
                                   "passed": same and summary[point]["rc"] == 0 and bool(summary[point]["markers"])
                                   and summary[point]["each_step_once"]})
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def stop(process: subprocess.Popen) -> None:
    """End a command started here and its children (it leads its own process group)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)  # SIGTERM: the trainer checkpoints and ends, so a rerun resumes
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run_part(part: int, steps: list[Step], args: argparse.Namespace, started: float) -> dict:
    folder = Path(args.out) / f"part{part}"
    folder.mkdir(parents=True, exist_ok=True)
    if part == 4:
        for point in ("none", "trainer", "capture"):  # a fresh run folder each call
            shutil.rmtree(Path(args.work) / f"fault-{point}", ignore_errors=True)
    ran, background = {}, []
    for step in steps:
        left = args.budget - (time.monotonic() - started)
        if left < 10:
            ran[step.name] = {"command": step.line(), "rc": None, "skipped": "no time left in --budget"}
            continue
        cap = min(step.cap, left)
        print(f"+ {step.line()}", flush=True)
        log = open(folder / f"{step.name}.log", "w")
        process = subprocess.Popen(step.argv, cwd=ROOT, env={**os.environ, **step.env}, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        begun = time.monotonic()
        if step.background:
            background.append((step, process, begun, cap))
            continue
        try:
            rc = process.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            stop(process)
            rc = "timed out"
        ran[step.name] = {"command": step.line(), "rc": rc, "seconds": round(time.monotonic() - begun, 1)}
        print(f"  {step.name}: rc {rc}", flush=True)
    background.sort(key=lambda entry: entry[0].name == "gpu-memory")  # the monitor is stopped last
    for step, process, begun, cap in background:  # the foreground is done: wait for the rest, monitors stopped
        if step.name == "gpu-memory":
            stop(process)
            rc = "stopped"
        else:
            try:
                rc = process.wait(timeout=max(1.0, min(cap - (time.monotonic() - begun),
                                                       args.budget - (time.monotonic() - started))))
            except subprocess.TimeoutExpired:
                stop(process)
                rc = "timed out"
        ran[step.name] = {"command": step.line(), "rc": rc, "seconds": round(time.monotonic() - begun, 1)}
    return summarize(part, folder, ran, args)


def visible_gpus() -> int:
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return len(os.environ["CUDA_VISIBLE_DEVICES"].split(","))
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="all", help="1, 2, 3, 4 or all (all: in order, one --budget for them)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: every visible one)")
    parser.add_argument("--out", default="/tmp/dflash-multi-gpu", help="results folder")
    parser.add_argument("--work", default=str(ROOT / "runs" / "multi_gpu"),
                        help="run folders of parts 3 and 4 (default runs/multi_gpu: ignored by git, kept when warm)")
    parser.add_argument("--zero", default="1,2,3", help="ZeRO stages of part 1 (comma list)")
    parser.add_argument("--steps", type=int, default=8, help="timed drafter steps per run (parts 1 and 2)")
    parser.add_argument("--smollm2-minutes", type=float, default=6.0, help="part 3's train.max_minutes")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds this call may take in all")
    parser.add_argument("--dry-run", action="store_true", help="print every command of the parts, run none")
    args = parser.parse_args(argv)
    args.gpus = args.gpus or visible_gpus()
    args.zero = [int(z) for z in args.zero.split(",")]
    if args.gpus < 2 and not args.dry_run:
        raise SystemExit(f"needs at least 2 GPUs, sees {args.gpus}")
    parts = [1, 2, 3, 4] if args.part == "all" else [int(args.part)]
    steps = plan(args)
    if args.dry_run:
        for part in parts:
            print(f"part {part}: results under {Path(args.out) / f'part{part}'}")
            for step in steps[part]:
                print(f"  {step.line()}")
        return
    started = time.monotonic()
    for part in parts:
        summary = run_part(part, steps[part], args, started)
        print(json.dumps({k: v for k, v in summary.items() if k != "commands"}, indent=2), flush=True)


if __name__ == "__main__":
    main()
