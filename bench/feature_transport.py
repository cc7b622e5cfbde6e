"""Features per second from a capture rank to a trainer rank (capture=online), without a target.

    python bench/feature_transport.py                                          # CPU: gloo through host memory
    python bench/feature_transport.py --width 25600 --tokens 1024 --units 40   # the Qwen3.6-27B shape (5 x 5120)

One capture rank and one trainer rank (a job of 2 processes made here with the package's own open_link): the capture
rank sends precomputed bf16 units (micro-batches of --micro-batch samples of --tokens tokens each) through
CaptureSender, the trainer rank takes them through LinkedFeatureSource.micro_batch (collate included: padding a
micro-batch) with --in-flight credits. Prints GB/s of feature bytes; docs/benchmarks.md records the figures beside
those of the file spool that online capture used before (0.27-0.34 GB/s on the same CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.data.batch_plan import BatchPlan  # noqa: E402
from dflash.extract.rank_stream import UnitStream  # noqa: E402
from dflash.extract.sample_format import sample_tensors  # noqa: E402


def samples(count: int, tokens: int, width: int) -> list[dict[str, torch.Tensor]]:
    return [sample_tensors(torch.randn(tokens, width, dtype=torch.bfloat16), torch.arange(tokens),
                           torch.ones(tokens, dtype=torch.long), torch.tensor([0, tokens])) for _ in range(count)]


def ranks_role(rank: int, port: int, args: argparse.Namespace, out) -> None:
    # The ranks meet in the store main() holds, as torchrun's ranks meet in its agent's store.
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2",
                       "LOCAL_RANK": str(rank), "TORCHELASTIC_USE_AGENT_STORE": "True",
                       "TORCHELASTIC_RESTART_COUNT": "0"})
    from dflash.extract.capture_sender import CaptureSender
    from dflash.extract.linked_source import LinkedFeatureSource
    from dflash.extract.rank_link import open_link

    link = open_link(1, "cpu", 600.0)
    plan = BatchPlan(args.units * args.micro_batch, args.micro_batch, 1, 1, seed=0)
    stream = UnitStream(plan, epochs=1)
    made = samples(args.micro_batch, args.tokens, args.width)
    if link.is_capture:
        sender = CaptureSender(link, stream, 0, lambda ids: [made[j % len(made)] for j in range(len(ids))],
                               [args.tokens] * plan.num_samples, batch_tokens=1, in_flight=args.in_flight)
        sender.run()
        return
    source = LinkedFeatureSource(link, stream, 0, 0, args.in_flight)
    started = time.perf_counter()
    for u in stream.trainer_units(0, 0):
        source.micro_batch(stream.indices(u))
    out["ranks_s"] = time.perf_counter() - started
    source.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2560, help="features per token (taps x hidden size)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per sample")
    parser.add_argument("--micro-batch", type=int, default=2, help="samples per unit")
    parser.add_argument("--units", type=int, default=40, help="micro-batches sent")
    parser.add_argument("--in-flight", type=int, default=4)
    args = parser.parse_args()
    feature_bytes = args.units * args.micro_batch * args.tokens * args.width * 2
    # Listening before either rank starts: a port found free here and handed to rank 0 could be taken by another
    # listener in the seconds before rank 0 bound it.
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=600), wait_for_workers=False)
    out = mp.Manager().dict()
    context = mp.get_context("spawn")
    processes = [context.Process(target=ranks_role, args=(r, store.port, args, out)) for r in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    print(f"{feature_bytes / 1e9:.2f} GB of bf16 features, {args.units} units of {args.micro_batch} x {args.tokens} "
          f"tokens x {args.width}")
    print(f"ranks (gloo, host memory): {feature_bytes / out['ranks_s'] / 1e9:.2f} GB/s ({out['ranks_s']:.2f} s)")


if __name__ == "__main__":
    main()
