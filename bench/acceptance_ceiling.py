"""The acceptance a perfect drafter reaches at temperature T under the serving engines' drafting rule: the ceiling a
trained drafter's live tau at T is measured against (issue 18). Prints JSON.

    python bench/acceptance_ceiling.py                       # real SmolLM2-135M on CPU, 16 prompts per set, T=1
    python bench/acceptance_ceiling.py --temperatures 0.6 1.0 --limit 32 --device cuda

vLLM and SGLang verify a DFlash block as deterministic proposals: the drafter proposes its argmax d_k at each block
position and the target accepts it with probability p_T(d_k | prefix) (docs/eval.md). The best any drafter can then
do is propose the target's own greedy continuation from the anchor, accepted at position k with probability
max_x p_T(x | prefix): a ceiling set by the target's confidence at T alone. (Under the rule that samples drafts from
the drafter's distribution q, a drafter with q = p_T accepts every draft: no such ceiling.)

Measured per prompt set with the replay estimate (dflash/eval/expected_acceptance.py), the perfect drafter's
logits being the target's own: along the target's continuations sampled at T (seed 0, plain sampling) the survival
of draft k is prod_{j<k} [d_j = s_j] * max p_T at position k, an unbiased estimate; along the target's greedy
continuation (T=0 path) the perfect drafts are the stored tokens and the survival is the exact product of the max
p_T: the ceiling from greedy contexts, which sampled decoding does not stay in.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash.eval.evaluate import load_prompt_sets  # noqa: E402
from dflash.eval.expected_acceptance import expected_traces  # noqa: E402
from dflash.eval.replay_estimate import sampled_continuations, target_pass_with_final  # noqa: E402
from dflash.models.targets.load import load_target  # noqa: E402
from dflash.models.targets.logit_transform import logits_from_hidden  # noqa: E402


def perfect_drafter(head: torch.Tensor, transform, finals: list[torch.Tensor]):
    """DraftLogits (expected_acceptance.py) of a drafter that proposes the target's own logits at each block position
    after the stored prefix: under the greedy rule, the target's greedy continuation wherever it survives."""
    def logits(rows: list[int], starts: list[int], sizes: list[int]) -> torch.Tensor:
        width = max(sizes) - 1
        blocks = []
        for row, start in zip(rows, starts):
            final = finals[row]
            # Block position k (k = 1..K) predicts token start + k from the target's state at start + k - 1.
            position = torch.clamp(torch.arange(start, start + width), max=final.shape[0] - 1)
            blocks.append(final[position.to(final.device)])
        return logits_from_hidden(torch.stack(blocks), head, transform)
    return logits


def ceiling_tau(adapter, prompts: list[list[int]], continuations: list[list[int]], *, temperature: float,
                path_temperature: float, max_new_tokens: int, block_size: int, batch_size: int) -> dict:
    """tau and the first per-position acceptance rates of the perfect drafter under the greedy rule at
    `temperature`, along `continuations` drawn at `path_temperature` (0: greedy)."""
    head, transform = adapter.lm_head_weight(), getattr(adapter, "logit_transform", None)
    steps = committed = 0.0
    hits, eligible = np.zeros(block_size - 1), np.zeros(block_size - 1)
    for first in range(0, len(prompts), batch_size):
        chunk = prompts[first : first + batch_size]
        sequences = [list(p) + c for p, c in zip(chunk, continuations[first : first + batch_size])]
        _, finals = target_pass_with_final(adapter, sequences, [1])
        traces = expected_traces(perfect_drafter(head, transform, finals), head, finals, sequences,
                                 [len(p) for p in chunk], block_size=block_size, max_new_tokens=max_new_tokens,
                                 temperature=temperature, path_temperature=path_temperature,
                                 draft_sampling="greedy", transform=transform)
        for trace in traces:
            steps, committed = steps + trace.steps, committed + trace.committed
            hits, eligible = hits + trace.hits, eligible + trace.eligible
    return {"tau": round(committed / steps, 4) if steps else None,
            "per_position": [round(h / e, 4) if e else None for h, e in zip(hits, eligible)][:6]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0])
    parser.add_argument("--limit", type=int, default=16, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    began = time.perf_counter()
    adapter = load_target("smollm2", device=args.device)
    specs = {name: {"source": name, "limit": args.limit} for name in ("humaneval", "mtbench", "gsm8k")}
    prompt_sets, _ = load_prompt_sets(adapter, specs, max_new_tokens=args.max_new_tokens)
    stops = adapter.stop_token_ids()
    result: dict = {"target": "smollm2", "limit": args.limit, "max_new_tokens": args.max_new_tokens,
                    "block_size": args.block_size, "rule": "greedy drafts (vLLM, SGLang)", "sets": {}}
    for name, prompts in prompt_sets.items():
        rows = result["sets"][name] = {}
        greedy = sampled_continuations(adapter, prompts, max_new_tokens=args.max_new_tokens, stop_token_ids=stops,
                                       temperature=0.0, seed=0, batch_size=args.batch_size, engine="hf")
        for temperature in args.temperatures:
            sampled = sampled_continuations(adapter, prompts, max_new_tokens=args.max_new_tokens,
                                            stop_token_ids=stops, temperature=temperature, seed=0,
                                            batch_size=args.batch_size, engine="hf")
            common = dict(temperature=temperature, max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                          batch_size=args.batch_size)
            rows[f"T={temperature}"] = {
                "sampled_path": ceiling_tau(adapter, prompts, sampled, path_temperature=temperature, **common),
                "greedy_path": ceiling_tau(adapter, prompts, greedy, path_temperature=0.0, **common)}
            print(name, temperature, json.dumps(rows[f"T={temperature}"]), file=sys.stderr, flush=True)
    result["seconds"] = round(time.perf_counter() - began, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
