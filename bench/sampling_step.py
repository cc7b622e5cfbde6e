"""The token choice of one decode step of the static engine at the data stage's shape: argmax (greedy answers) against
temperature + top-p sampling (the synthetic prompts), and the pieces of the latter.

    python bench/sampling_step.py --rows 1024 --vocab 49152 --out sampling_step.json

Each variant runs on the same float32 logits [rows, vocab] (a normal draw times --scale: at the default 4 the top-p
nucleus holds ~650 of 49,152 tokens, printed as mean_nucleus_tokens), timed with CUDA events over --iters calls
after a warm-up, and reported in ms per call and as a ratio to a bf16 [rows, hidden] x [hidden, vocab] matmul (the
lm_head of the same step) measured in the same run:
  * argmax:        logits.argmax(-1)
  * sample_top_p:  dflash.inference.keyed_sampling.sample_tokens at --temperature and --top-p (what the engine runs)
  * sample_full:   the same with top_p 1 (no sort)
  * sort:          torch.sort(probs, descending=True) alone
  * softmax:       torch.softmax(logits / T) alone
On CPU (no CUDA) it runs a small shape once as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash.inference.keyed_sampling import sample_tokens  # noqa: E402


def timed(fn, iters: int, cuda: bool) -> float | None:
    """Milliseconds per call of fn (after two warm-up calls); None without CUDA (the smoke test)."""
    fn()
    fn()
    if not cuda:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--scale", type=float, default=4.0)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    rows, vocab = (args.rows, args.vocab) if cuda else (8, 512)
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, vocab, device=device, generator=generator) * args.scale
    uniform = torch.rand(rows, device=device, generator=generator)
    hidden = torch.randn(rows, args.hidden, device=device, dtype=torch.bfloat16)
    head = torch.randn(args.hidden, vocab, device=device, dtype=torch.bfloat16)
    probs = torch.softmax(logits / args.temperature, dim=-1)
    nucleus = (probs.sort(dim=-1, descending=True).values.cumsum(-1) < args.top_p).sum(-1).float().mean().item() + 1

    variants = {
        "matmul_bf16": lambda: hidden @ head,
        "argmax": lambda: logits.argmax(dim=-1),
        "sample_top_p": lambda: sample_tokens(logits, args.temperature, args.top_p, uniform),
        "sample_full": lambda: sample_tokens(logits, args.temperature, 1.0, uniform),
        "sort": lambda: probs.sort(dim=-1, descending=True),
        "softmax": lambda: torch.softmax(logits / args.temperature, dim=-1),
    }
    ms = {name: timed(fn, args.iters, cuda) for name, fn in variants.items()}
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "rows": rows, "vocab": vocab, "temperature": args.temperature, "top_p": args.top_p,
              "mean_nucleus_tokens": round(nucleus, 1), "ms": {k: v and round(v, 4) for k, v in ms.items()},
              "vs_matmul": {k: round(v / ms["matmul_bf16"], 2) for k, v in ms.items()} if cuda else None}
    print(f"{result['device']}, torch {result['torch']}, logits [{rows}, {vocab}], T={args.temperature}, "
          f"top_p={args.top_p}, mean nucleus {result['mean_nucleus_tokens']} tokens")
    for name, value in ms.items():
        if value is None:
            print(f"  {name:<14} ran (no CUDA: not timed)")
        else:
            print(f"  {name:<14} {value:9.4f} ms  {value / ms['matmul_bf16']:7.2f}x the bf16 lm_head matmul")
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
