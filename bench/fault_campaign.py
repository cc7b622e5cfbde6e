"""A randomized fault campaign on the tiny pipeline (issue 24): SIGKILLs at random moments, then a random corruption,
each trial checked against an uninterrupted run of the same command.

    python bench/fault_campaign.py                                    # 8 trials, up to 3 kills each, a corruption each
    python bench/fault_campaign.py --trials 20 --kills 2 --seed 1 --out /tmp/campaign
    python bench/fault_campaign.py --no-corrupt --epochs 40           # the issue's run: 200 steps, kills only

Each trial makes a fresh run folder and runs `python -m dflash.train +experiment=tiny ...` (data, capture, train with
a checkpoint every 2 steps and held-out evaluations, export, eval) in its own process group, SIGKILLed after a random
delay within the reference's wall time, up to --kills times (a run that ends first is not killed again). Then one
random fault is applied (a checkpoint's model or optimizer states flipped or cut to half, a feature shard flipped, an
export flipped, checkpoints/best flipped) and the same command runs until it ends (a corrupt shard takes two runs: the
first sets it aside, the second recaptures it). A trial passes when it ends with the reference's per-step losses
(bit for bit, each step once), exported weights and evaluation, no temporary, half-deleted or incomplete folder and no
process left; or, for a fault that cannot be repaired (best/), with a non-zero exit naming the bad file.
The checks are the suite's (tests/test_fault_campaign.py), which applies each fault once at a fixed point.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_checkpoint_integrity import flip, model_states  # noqa: E402
from tests.test_fault_campaign import cut_to_half, leftovers, losses, optimizer_states  # noqa: E402
from tests.test_store_repair import flip as flip_shard, sha  # noqa: E402

FAULTS = ("model states flipped", "optimizer states flipped", "model states cut to half", "shard flipped",
          "export flipped", "best flipped")


def command(run_dir: Path, epochs: int) -> list[str]:
    return [sys.executable, "-m", "dflash.train", "+experiment=tiny", "show_progress=false", "capture.shard_tokens=300",
            "train.save_every=2", f"train.epochs={epochs}", "data.heldout=4", "train.eval_every=8",
            f"run_dir={run_dir}"]


def launch(run_dir: Path, epochs: int, kill_after: float | None) -> tuple[int, str, bool]:
    """(exit status, stderr, whether a process of its group outlived it): one run, SIGKILLed (with its whole
    process group) after `kill_after` seconds unless it ended first."""
    log = open(run_dir.parent / f"{run_dir.name}.stderr", "w+")
    process = subprocess.Popen(command(run_dir, epochs), stdout=subprocess.DEVNULL, stderr=log,
                               start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        process.wait(timeout=kill_after)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    time.sleep(0.5)
    try:
        os.killpg(process.pid, 0)
        survived = True
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        survived = False
    log.seek(0)
    return process.returncode, log.read(), survived


def corrupt(run_dir: Path, fault: str) -> Path | None:
    """Apply `fault` to the run folder; the file it spoiled, or None when the folder has no such file yet."""
    checkpoints = run_dir / "checkpoints"
    latest = checkpoints / "latest"
    if fault.startswith(("model", "optimizer")):
        if not latest.exists():
            return None
        tag = str(checkpoints / latest.read_text().strip())
        bad = Path(optimizer_states(tag) if fault.startswith("optimizer") else model_states(tag))
        (cut_to_half if fault.endswith("half") else flip)(str(bad))
        return bad
    if fault == "shard flipped":
        shards = sorted((run_dir / "features").glob("shard-*.safetensors"))
        if not shards:
            return None
        flip_shard(shards[len(shards) // 2])
        return shards[len(shards) // 2]
    folder = run_dir / ("export" if fault == "export flipped" else "checkpoints/best")
    if not (folder / "model.safetensors").exists():
        return None
    flip(str(folder / "model.safetensors"))
    return folder / "model.safetensors"


def end_state(run_dir: Path, reference: Path) -> list[str]:
    """What differs from the reference's end state (empty: the same)."""
    problems = []
    steps = [step for step, _ in losses(run_dir)]
    if len(steps) != len(set(steps)):
        problems.append("duplicate metrics records")
    if losses(run_dir) != losses(reference):
        problems.append("other losses")
    for file in ("export/model.safetensors", "export_best/model.safetensors"):
        if sha(run_dir / file) != sha(reference / file):
            problems.append(f"other {file}")
    taus = [json.loads((folder / "eval" / "summary.json").read_text())["overall"]["tau"]
            for folder in (run_dir, reference)]
    if taus[0] != taus[1]:
        problems.append(f"eval tau {taus[0]} != {taus[1]}")
    return problems + [f"left behind: {path}" for path in leftovers(run_dir)]


def trial(out: Path, index: int, reference: Path, duration: float, args, rng: random.Random) -> dict:
    run_dir = out / f"trial{index}"
    kills, survivors, killed_last = 0, 0, False
    for _ in range(args.kills):
        status, _, survived = launch(run_dir, args.epochs, rng.uniform(0.5, 0.8 * duration))
        survivors += survived
        killed_last = status == -signal.SIGKILL
        if not killed_last:
            break
        kills += 1
    fault = rng.choice(FAULTS) if args.corrupt else None
    bad = corrupt(run_dir, fault) if fault else None
    status, err, survived = launch(run_dir, args.epochs, None)
    survivors += survived
    named = bad is not None and bad.name in err
    if status != 0 and fault == "shard flipped" and named:
        status, more, survived = launch(run_dir, args.epochs, None)  # the shard set aside is recaptured
        survivors, err = survivors + survived, err + more
    if status != 0:
        problems = [] if named and fault == "best flipped" else [f"exit {status}: {err.strip()[-300:]}"]
    else:
        problems = end_state(run_dir, reference)
    if survivors:
        problems.append(f"{survivors} process(es) outlived a run")
    # A fault applied to a finished run is harmless unless something reads the file again; one applied mid-run
    # (the last launch killed) is met by the resumed run, which must name it.
    result = {"trial": index, "kills": kills, "fault": fault if bad is not None else None,
              "mid_run": killed_last, "named": named, "ended": "exit 0" if status == 0 else f"exit {status}",
              "problems": problems}
    print(json.dumps(result), flush=True)
    if not problems and not args.keep:
        shutil.rmtree(run_dir)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs per trial at most")
    parser.add_argument("--epochs", type=int, default=10, help="train.epochs (10: 50 steps; the issue ran 40)")
    parser.add_argument("--corrupt", action=argparse.BooleanOptionalAction, default=True,
                        help="a random corruption after the kills of each trial")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="/tmp/dflash-fault-campaign")
    parser.add_argument("--keep", action="store_true", help="keep the run folders of trials that passed")
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.perf_counter()
    status, err, _ = launch(out / "reference", args.epochs, None)
    if status != 0:
        raise SystemExit(f"the reference run failed: {err[-2000:]}")
    duration = time.perf_counter() - started
    print(f"reference: {duration:.0f} s, {len(losses(out / 'reference'))} steps", flush=True)
    rng = random.Random(args.seed)
    results = [trial(out, i, out / "reference", duration, args, rng) for i in range(args.trials)]
    failed = [r for r in results if r["problems"]]
    faults = [r for r in results if r["fault"] is not None]
    print(f"{len(results)} trials, {sum(r['kills'] for r in results)} SIGKILLs, {len(faults)} corruptions "
          f"({sum(r['mid_run'] for r in faults)} mid-run, {sum(r['named'] for r in faults)} named): {len(failed)} "
          f"failed ({time.perf_counter() - started:.0f} s)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
