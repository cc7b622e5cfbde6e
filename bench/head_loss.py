"""Time the lm_head + cross-entropy of one training step: head_cross_entropy against checkpointed autograd chunks.

    python bench/head_loss.py                      # GPU: the SmolLM2 recipe's and the Qwen3.6-27B drafter's shapes
    python bench/head_loss.py --tiny               # CPU: a small shape, checks the script

Both compute sum_i w_i CE_i over `rows` block positions through a frozen [vocab, hidden] head and the gradient for
the hidden states (forward + backward, timed together, median of --steps):
  head_cross_entropy: the trainer's path (dflash/train/head_cross_entropy.py), logits made once per chunk, the
                      softmax / CE / argmax / gradient logits of each chunk in one compiled function on CUDA (the
                      warm-up step compiles it);
  eager_chunks:       the same with that chunk function in eager torch (what runs on CPU);
  checkpointed:       autograd over chunks under activation checkpointing, logits upcast to float32, the way the
                      trainer computed it before (each chunk's logits made twice).
Prints one JSON object: per shape and path, milliseconds, TFLOP/s by 4 x rows x vocab x hidden (logits + hidden
gradient; the checkpointed path does 6x that work but is credited 4x), peak memory, and the speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash.train.head_cross_entropy import head_cross_entropy, head_loss  # noqa: E402

SHAPES = {  # rows = query positions with a loss in one step
    "smollm2": dict(rows=16 * 256 * 15, hidden=576, vocab=49152),
    "qwen36": dict(rows=512 * 15, hidden=5120, vocab=248320),
    "tiny": dict(rows=2048, hidden=64, vocab=4096),
}


def checkpointed_loss(hidden, head, labels, weights, chunk_size):
    def chunk_loss(h, y, w):
        logits = (h @ head.t()).float()
        return (F.cross_entropy(logits, y, reduction="none") * w).sum()

    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_size):
        end = start + chunk_size
        total = total + checkpoint(chunk_loss, hidden[start:end], labels[start:end], weights[start:end],
                                   use_reentrant=False)
    return total


def fused_loss(hidden, head, labels, weights, chunk_size):
    ce, _ = head_cross_entropy(hidden, head, labels, chunk_size)
    return (ce * weights).sum()


def eager_chunk_loss(hidden, head, labels, weights, chunk_size):
    terms, _, _ = head_loss(hidden, head, labels, chunk_size, fused=False)
    return (terms * weights).sum()


def measure(shape: dict, device: torch.device, dtype: torch.dtype, steps: int, chunk_size: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    head = (torch.randn(shape["vocab"], shape["hidden"], generator=generator) * 0.02).to(device, dtype)
    hidden = torch.randn(shape["rows"], shape["hidden"], generator=generator).to(device, dtype)
    labels = torch.randint(0, shape["vocab"], (shape["rows"],), generator=generator).to(device)
    weights = torch.rand(shape["rows"], generator=generator).to(device)
    flops = 4.0 * shape["rows"] * shape["vocab"] * shape["hidden"]
    result = {}
    paths = (("head_cross_entropy", fused_loss), ("eager_chunks", eager_chunk_loss),
             ("checkpointed", checkpointed_loss))
    for name, loss_fn in paths:
        times, grads = [], None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(steps + 1):  # the first is a warm-up
            leaf = hidden.clone().requires_grad_()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            loss = loss_fn(leaf, head, labels, weights, chunk_size)
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
            grads = leaf.grad
        seconds = sorted(times[1:])[len(times[1:]) // 2]
        result[name] = {"ms": round(seconds * 1e3, 2), "tflops": float(f"{flops / seconds / 1e12:.3g}"),
                        "loss": round(loss.item(), 3), "grad_norm": round(grads.float().norm().item(), 4)}
        if device.type == "cuda":
            result[name]["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    result["speedup"] = round(result["checkpointed"]["ms"] / result["head_cross_entropy"]["ms"], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--shapes", default="smollm2,qwen36")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--chunk-size", type=int, default=4096)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    names = ["tiny"] if args.tiny else args.shapes.split(",")
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype), "chunk_size": args.chunk_size, "shapes": {}}
    if device.type == "cuda":
        from dflash.train.step_metrics import measure_matmul_tflops

        report["matmul_bf16_tflops"] = round(measure_matmul_tflops(device), 1)
    for name in names:
        report["shapes"][name] = {**SHAPES[name], **measure(SHAPES[name], device, dtype, args.steps, args.chunk_size)}
        print(json.dumps({name: report["shapes"][name]}), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
