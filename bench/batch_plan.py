"""Time the batch plan's work per training step on both sides of capture=online; print JSON.

    python bench/batch_plan.py                         # 200k samples, 12 trainer ranks, grad_accum 4, mb 1
    python bench/batch_plan.py --samples 20000 --steps 3

At each shape (group_by_length 0 and 8) it times, over --steps steps of the second epoch:
  capture_step_ms  a capture rank serving every trainer rank: UnitStream.indices of the step's
                   trainers x grad_accum units (the micro-batches it captures), on its critical path
  trainer_step_ms  a trainer rank: BatchPlan.micro_batches of its step (what prepare_batches reads)
  order_ms         one computation of the epoch's order (BatchPlan._order, uncached)
each "cached" (each epoch's order computed once per plan and epoch, dflash/data/batch_plan.py) and "recomputed"
(the order computed again on every call, as before that cache: the cache is cleared before each call). The first
epoch's order is computed before the cached timing starts, as it is once per epoch in a run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash.data.batch_plan import BatchPlan  # noqa: E402
from dflash.extract.rank_stream import UnitStream  # noqa: E402


def per_step_ms(work, steps: int, recompute: bool) -> float:
    """Milliseconds per step of work(step) over `steps` steps; recompute: every plan call computes the order."""
    total = 0.0
    for step in range(steps):
        started = time.perf_counter()
        work(step, recompute)
        total += time.perf_counter() - started
    return 1000 * total / steps


def measure(plan: BatchPlan, steps: int) -> dict:
    stream, epoch = UnitStream(plan, 2), 1
    units = stream.units_per_step

    def capture_step(step: int, recompute: bool) -> None:
        first = stream.first_unit(epoch * plan.steps_per_epoch + step)
        for u in range(first, first + units):
            if recompute:
                BatchPlan._order.cache_clear()
            stream.indices(u)

    def trainer_step(step: int, recompute: bool) -> None:
        if recompute:
            BatchPlan._order.cache_clear()
        plan.micro_batches(epoch, step, 0)

    started = time.perf_counter()
    BatchPlan._order.__wrapped__(plan, epoch)
    result = {"order_ms": round(1000 * (time.perf_counter() - started), 1)}
    for name, work in (("capture_step_ms", capture_step), ("trainer_step_ms", trainer_step)):
        recomputed = per_step_ms(work, steps, True)
        BatchPlan._order.cache_clear()
        plan.epoch_order(epoch)  # computed once when the epoch starts
        result[name] = {"recomputed": round(recomputed, 1), "cached": round(per_step_ms(work, steps, False), 3)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--trainers", type=int, default=12)
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    lengths = tuple(random.Random(0).randint(64, 8192) for _ in range(args.samples))
    shape = {"samples": args.samples, "trainers": args.trainers, "grad_accum": args.grad_accum,
             "micro_batch": args.micro_batch, "units_per_step": args.trainers * args.grad_accum}
    results = []
    for group_by_length in (0, 8):
        plan = BatchPlan(args.samples, args.micro_batch, args.trainers, args.grad_accum, seed=0,
                         group_by_length=group_by_length, lengths=lengths)
        results.append({"group_by_length": group_by_length, **measure(plan, args.steps)})
    print(json.dumps({"shape": shape, "results": results}, indent=1))


if __name__ == "__main__":
    main()
