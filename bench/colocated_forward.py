"""Time the colocated capture's target forward, one micro-batch at a time, with and without capture.cuda_graphs;
print JSON.

    python bench/colocated_forward.py                    # one GPU: the real SmolLM2 at the GPU default's 32 rows
    python bench/colocated_forward.py --compile          # the target's layers compiled (capture.compile), both paths
    python bench/colocated_forward.py --tiny             # CPU smoke check (a tiny llama, no graphs)

Paths, each over the same right-padded micro-batches of random ids (`--rows` rows, widths drawn uniformly from
`--widths`, one fresh batch per call as in training):
  adapter:  TargetAdapter.capture with the padding mask (the colocated default)
  static:   dflash/extract/static_capture.py's forward, replayed as CUDA graphs on a GPU (eagerly on a CPU)
Per path: `host_ms` (the call's own time, the device not waited for: what the host spends issuing the forward),
`device_ms` (CUDA events around each call, the GPU's time for it), `wall_ms` (a loop of calls with one wait at the
end, per call: the larger of the two once the queue is full). A training step that the host bounds gains the host
time a path saves; one that the GPU bounds gains nothing, or loses what a path adds to device time. Graph captures
and compilation happen in untimed warm-up calls first (`--warmup`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash.extract.static_capture import StaticCapture  # noqa: E402
from dflash.models.targets import build_tiny_target, load_target  # noqa: E402
from dflash.models.targets.compile_target import target_layers_compiled  # noqa: E402

TAPS = [1, 8, 15, 22, 28]  # five taps spread over SmolLM2's 30 layers, as the recipe's drafter reads them


def micro_batches(adapter, rows: int, widths: tuple[int, int], count: int, seed: int) -> list[tuple]:
    """`count` right-padded batches (ids with the pad token on the padding, mask) on the target's device."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        lengths = torch.randint(widths[0], widths[1] + 1, (rows,), generator=g)
        width = int(lengths.max())
        mask = (torch.arange(width)[None] < lengths[:, None]).long()
        ids = torch.randint(3, adapter.vocab_size, (rows, width), generator=g)
        ids = ids.masked_fill(mask == 0, adapter.tokenizer.pad_token_id)
        batches.append((ids.to(adapter.device), mask.to(adapter.device)))
    return batches


def time_path(forward, batches: list[tuple], warmup: int, cuda: bool) -> dict[str, float]:
    """host_ms, device_ms (CUDA) and wall_ms per call of forward(ids, mask) over `batches`, after `warmup` calls."""
    for ids, mask in batches[:warmup]:
        forward(ids, mask)
    timed = batches[warmup:]
    if cuda:
        torch.cuda.synchronize()
    host, device = [], []
    for ids, mask in timed:
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        end = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            torch.cuda.synchronize()
            start.record()
        began = time.perf_counter()
        forward(ids, mask)
        host.append((time.perf_counter() - began) * 1e3)
        if cuda:
            end.record()
            end.synchronize()
            device.append(start.elapsed_time(end))
    began = time.perf_counter()
    for ids, mask in timed:
        forward(ids, mask)
    if cuda:
        torch.cuda.synchronize()
    figures = {"host_ms": statistics.median(host), "wall_ms": (time.perf_counter() - began) * 1e3 / len(timed)}
    if device:
        figures["device_ms"] = statistics.median(device)
    return figures


def measure(adapter, args, cuda: bool) -> dict[str, dict[str, float]]:
    batches = micro_batches(adapter, args.rows, tuple(args.widths), args.warmup + args.calls, args.seed)
    static = StaticCapture(adapter, args.taps, args.final, max_width=args.widths[1],
                           pad_id=adapter.tokenizer.pad_token_id, cuda_graphs=cuda)
    paths = {
        "adapter": (lambda ids, mask: adapter.capture_with_final(ids, mask, args.taps) if args.final
                    else adapter.capture(ids, mask, args.taps)),
        "static": lambda ids, mask: static(ids),
    }
    # The graphs of every width are captured at the first static call, inside the warm-up.
    results = {name: time_path(forward, batches, args.warmup, cuda) for name, forward in paths.items()}
    results["static"]["graphs"] = len(static.graphs)
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny llama on the CPU (checks the script)")
    parser.add_argument("--compile", action="store_true", help="compile the target's layers (capture.compile)")
    parser.add_argument("--rows", type=int, default=32, help="rows a micro-batch (train.micro_batch_size)")
    parser.add_argument("--widths", type=int, nargs=2, default=(300, 900), help="sample lengths drawn from [a, b]")
    parser.add_argument("--taps", type=int, nargs="+", default=TAPS, help="the decoder layers captured")
    parser.add_argument("--final", action="store_true", help="also the final normed state (train.kl_weight > 0)")
    parser.add_argument("--calls", type=int, default=30, help="timed calls a path")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls a path first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.tiny:
        adapter = build_tiny_target("llama", 0, tokenizer="builtin")
        args.taps = [1, 4, 6] if args.taps == TAPS else args.taps
        args.rows, args.widths, args.calls, args.warmup = min(args.rows, 4), (8, 40), min(args.calls, 3), 1
    else:
        adapter = load_target("smollm2", device="cuda", dtype="bfloat16")
    cuda = adapter.device.type == "cuda"
    with target_layers_compiled(adapter, args.compile):
        results = measure(adapter, args, cuda)
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "target": "tiny llama" if args.tiny else "SmolLM2-135M-Instruct", "dtype": str(adapter.dtype),
              "compile": args.compile, "rows": args.rows, "widths": list(args.widths), "taps": args.taps,
              "final": args.final, "calls": args.calls, "paths": results}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
