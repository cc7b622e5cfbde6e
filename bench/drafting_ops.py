"""Operators of one live drafting step of the static engine (dflash/inference/static_drafter.py) at the SmolLM2
recipe's drafter shape: the block step (the block's embedding, the drafter, lm_head, argmax) and the context extend
of 4 verified positions, eagerly on this machine's CPU with random weights.

    python bench/drafting_ops.py --out drafting_ops.json
    python bench/drafting_ops.py --compile --out drafting_ops_compiled.json   # eval.compile_drafter's layers

On a GPU each step is one CUDA graph, and a graph of a small drafter is bound by how many kernels it holds (session
33's H100 breakdown: a 5-layer block step took 0.81 ms, about 300 kernels), so the count of operators that are not
views (each one or more kernels there) is the figure to bring down; the count is the same on any machine. The table
lists the most frequent operators of each step. With --compile the drafter's layers go through torch.compile
(dflash/train/compile_layers.py, what eval.compile_drafter does) and each compiled graph counts the kernels it calls:
inductor's fused kernels (C++ on this machine, Triton on a GPU, where the fusion can differ) and the operators it
leaves to aten (matmuls, attention)."""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash.inference.drafter_cache import TargetHead  # noqa: E402
from dflash.inference.static_drafter import StaticDrafter  # noqa: E402
from dflash.models.drafter import DFlashDraftModel  # noqa: E402
from dflash.models.drafter_config import DrafterConfig  # noqa: E402
from dflash.train.compile_layers import compile_layers  # noqa: E402

# Operators that make a view of a tensor: no kernel.
VIEWS = {"aten::unsqueeze", "aten::transpose", "aten::view", "aten::slice", "aten::chunk", "aten::alias",
         "aten::reshape", "aten::expand", "aten::select", "aten::split", "aten::squeeze", "aten::t", "aten::permute",
         "aten::detach", "aten::_unsafe_view", "aten::as_strided", "aten::lift_fresh"}


# The profiler event under which a compiled graph calls its kernels.
COMPILED_GRAPH = "## Call CompiledFxGraph"


def top_level_operators(fn) -> collections.Counter:
    """The aten operators `fn` dispatches from Python (those inside another operator not counted), and the kernels
    each compiled graph calls (its fused kernels, named "fused ...", and the aten operators it calls itself)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counted = collections.Counter()
    for e in prof.events():
        parent = e.cpu_parent
        if parent is None and e.name.startswith("aten::"):
            counted[e.name] += 1
        elif parent is not None and parent.name.startswith(COMPILED_GRAPH):
            counted[e.name if e.name.startswith("aten::") else "fused kernel"] += 1
    return counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--context", type=int, default=300, help="positions in the drafter's context")
    parser.add_argument("--compile", action="store_true", help="the drafter's layers through torch.compile")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.compile:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # each fused C++ kernel is a profiler event
    vocab, hidden = 49152, 576
    config = DrafterConfig(hidden_size=hidden, intermediate_size=1536, num_hidden_layers=args.layers,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=vocab,
                           num_target_layers=30, target_layer_ids=[1, 8, 14, 20, 27], mask_token_id=2,
                           block_size=16, layer_types=["full_attention"] * args.layers)
    torch.manual_seed(0)
    drafter = DFlashDraftModel(config).to(torch.bfloat16).eval()
    if args.compile:
        compile_layers(drafter)
    embedding = nn.Embedding(vocab, hidden).to(torch.bfloat16)
    context = StaticDrafter(drafter, TargetHead(embedding, embedding.weight, None), 1024, cuda_graphs=False)
    features = torch.randn(args.context, config.num_taps * hidden, dtype=torch.bfloat16)
    context.extend(features)
    for _ in range(2):  # compiled: the first calls compile (the graphs a GPU would capture come after warm-ups)
        context.draft(5, config.block_size)
        context.extend(features[:4])
    steps = {"block": top_level_operators(lambda: context.draft(5, config.block_size)),
             "extend": top_level_operators(lambda: context.extend(features[:4]))}
    result = {"torch": torch.__version__, "layers": args.layers, "block_size": config.block_size,
              "compiled": args.compile, "steps": {}}
    for name, counted in steps.items():
        kernels = sum(n for op, n in counted.items() if op not in VIEWS)
        result["steps"][name] = {"operators": sum(counted.values()), "not_views": kernels,
                                 "most_frequent": dict(counted.most_common(12))}
        print(f"{name:8s} {sum(counted.values()):4d} operators, {kernels:4d} not views; "
              + ", ".join(f"{op.removeprefix('aten::')} {n}" for op, n in counted.most_common(8)))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
