"""The acceptance a perfect drafter reaches at temperature T: the ceiling a trained drafter's live tau at T is measured
against (issue 18), under two drafting rules. Prints JSON.

    python bench/acceptance_ceiling.py                       # real SmolLM2-135M on CPU, 16 prompts per set, T=1
    python bench/acceptance_ceiling.py --temperatures 0.6 1.0 --limit 32 --device cuda
    python bench/acceptance_ceiling.py --rules sampled --limit 3 --max-new-tokens 48 --anchor-stride 8

`greedy` rule (vLLM, SGLang): the drafter proposes its argmax d_k at each block position and the target accepts it
with probability p_T(d_k | prefix) (docs/eval.md). The best any drafter can do is propose the target's own greedy
continuation from the anchor, accepted at position k with probability max_x p_T(x | prefix): a ceiling set by the
target's confidence at T alone. Measured with the replay estimate (dflash/eval/expected_acceptance.py), the perfect
drafter's logits being the target's own: along the target's continuations sampled at T (seed 0, plain sampling)
the survival of draft k is prod_{j<=k} [d_j = s_j], the steps of a live decode of that drafter coupled to the pass
(exact in expectation); along the target's greedy continuation (T=0 path) the survival is the exact product of the
max p_T: the ceiling from greedy contexts, which sampled decoding does not stay in.

`sampled` rule (speculative rejection sampling): draft y_k ~ q_k, accepted with min(1, p_T(y_k | c, y_<k) / q_k(y_k)).
A DFlash drafter predicts the whole block in one forward, so q_k cannot depend on the drafts y_<k of its own block,
while the target's p_T(. | c, y_<k) does: a drafter with q = p_T does not exist. A drafter that matches the target's
distribution (a KL loss along the target's own sampled answers) learns its marginal at block position k,
m_k(x) = E_{y_<k ~ p_T}[p_T(x | c, y_<k)] (m_1 = p_T(. | c)). Its ceiling is measured at anchors c every
`--anchor-stride` tokens along the target's continuation sampled at T: m_k is the mean of the target's conditionals
along `--rollouts` rollouts of it from c; `--drafts` blocks y ~ m (independent positions) are verified by one
target forward over c + y, and each block's expected accepted count is sum_k prod_{j<=k} min(1, p_j(y_j) / m_j(y_j))
(the acceptance probabilities, not uniform draws). tau = 1 + that count (the target's bonus or correction token),
block_size - 1 drafted positions, no max_new_tokens cut. A drafter sharper than m can accept more (the greedy rule
is the sampled rule with a point-mass q): `--sharpen b` also scores q_k proportional to m_k^b, and the same anchors'
greedy-rule ceiling (the target's greedy chain from c, survival prod max p_T) is reported beside it.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash.eval.evaluate import load_prompt_sets  # noqa: E402
from dflash.eval.expected_acceptance import expected_traces  # noqa: E402
from dflash.eval.replay_estimate import sampled_continuations, target_pass_with_final  # noqa: E402
from dflash.inference.target_cache import crop_attention, has_linear_layers, new_cache  # noqa: E402
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
    # Tokens and expected steps as well, so that sets pool into an overall tau (tokens over steps).
    return {"tau": round(committed / steps, 4) if steps else None, "num_tokens": committed, "num_steps": steps,
            "per_position": [round(h / e, 4) if e else None for h, e in zip(hits, eligible)][:6]}


# The target's distributions at T along `count` rollouts of its own from the anchor: (tokens [count, K-1],
# probabilities [count, K, V]); the generator draws the tokens, greedy=True takes the argmax instead.
Rollout = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# The target's distributions at T along given blocks: drafts [S, K] -> p_T(. | c, y_<k) [S, K, V].
Along = Callable[[torch.Tensor], torch.Tensor]


def sharpened(marginals: torch.Tensor, power: float) -> torch.Tensor:
    """q_k proportional to m_k^power [K, V]: 1 is the marginal itself, a larger power a more confident drafter."""
    if power == 1.0:
        return marginals
    log_q = power * torch.log(marginals.clamp_min(torch.finfo(marginals.dtype).tiny))
    return torch.softmax(log_q, dim=-1)


def draft_survival(proposal: torch.Tensor, drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """P(drafts 1..k all accepted) [S, K] of S blocks drafted from `proposal` q [K, V] (drafts [S, K], y_k ~ q_k),
    verified by speculative rejection sampling against the target's conditionals `target` [S, K, V] along them:
    prod_{j<=k} min(1, p_j(y_j) / q_j(y_j))."""
    q = proposal.gather(-1, drafts.T).T
    p = target.gather(-1, drafts[..., None]).squeeze(-1)
    return torch.cumprod(torch.clamp(p / q, max=1.0), dim=1)


def block_parallel_survival(rollout: Rollout, along: Along, *, rollouts: int, drafts: int, generator: torch.Generator,
                            powers: tuple[float, ...] = (1.0,)) -> dict[float, torch.Tensor]:
    """Per power b, the survival [drafts, K] of blocks drafted independently per position from q_k ~ m_k^b, m_k the
    target's marginal at block position k estimated from `rollouts` of its own (module docstring)."""
    _, probs = rollout(rollouts, generator)
    marginals = probs.mean(dim=0)
    result = {}
    for power in powers:
        proposal = sharpened(marginals, power)
        blocks = torch.multinomial(proposal, drafts, replacement=True, generator=generator).T
        result[power] = draft_survival(proposal, blocks, along(blocks))
    return result


class AnchorTarget:
    """`rollout` and `along` of an HF causal LM at one anchor, over a KV cache of the context c[:-1] (batch 1): every
    call feeds c's last token first, so p_T(. | c) is computed in the same forward as the later positions."""

    def __init__(self, model: torch.nn.Module, cache: Any, context: list[int], *, temperature: float, positions: int):
        self.model, self.cache, self.temperature, self.positions = model, cache, temperature, positions
        self.length = len(context) - 1
        self.last = torch.tensor([[context[-1]]], device=model.device)
        # transformers 5.24 renamed `past_key_values` to `cache` (as dflash/inference/target_cache.py reads it).
        self.argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def _forward(self, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        start = cache.get_seq_length()
        positions = torch.arange(start, start + ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        # An explicit all-ones mask: SDPA over a cache takes a faster path with one (target_cache.py).
        mask = torch.ones(ids.shape[0], start + ids.shape[1], dtype=torch.long, device=ids.device)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                            **{self.argument: cache}).logits
        return torch.softmax(logits.float() / self.temperature, dim=-1)

    def _cache(self, count: int) -> Any:
        cache = copy.deepcopy(self.cache)
        crop_attention(cache, self.length)
        cache.batch_repeat_interleave(count)
        return cache

    @torch.inference_mode()
    def rollout(self, count: int, generator: torch.Generator | None = None,
                greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        cache, token, tokens, probs = self._cache(count), self.last.expand(count, 1), [], []
        for k in range(self.positions):
            probs.append(self._forward(token, cache)[:, -1])
            if k < self.positions - 1:
                token = (probs[-1].argmax(dim=-1, keepdim=True) if greedy
                         else torch.multinomial(probs[-1], 1, generator=generator))
                tokens.append(token)
        empty = torch.empty(count, 0, dtype=torch.long, device=self.last.device)
        return torch.cat(tokens, dim=1) if tokens else empty, torch.stack(probs, dim=1)

    @torch.inference_mode()
    def along(self, drafts: torch.Tensor) -> torch.Tensor:
        ids = torch.cat([self.last.expand(drafts.shape[0], 1), drafts[:, :-1].to(self.last.device)], dim=1)
        return self._forward(ids, self._cache(drafts.shape[0]))


@torch.inference_mode()
def context_cache(model: torch.nn.Module, sequence: list[int]) -> Any:
    """A KV cache of the whole `sequence` (batch 1) that AnchorTarget crops to each anchor's context."""
    cache = new_cache(model)
    if has_linear_layers(cache):
        raise ValueError("the sampled-rule ceiling crops the cache per anchor: attention-only targets")
    model(input_ids=torch.tensor([sequence], device=model.device), use_cache=True,
          **{"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache})
    return cache


def anchor_records(adapter, prompts: list[list[int]], continuations: list[list[int]], *, temperature: float,
                   block_size: int, anchor_stride: int, rollouts: int, drafts: int, powers: tuple[float, ...],
                   seed: int) -> list[dict]:
    """Per anchor (every `anchor_stride` tokens of each continuation, from its first): the prompt's index, the mean
    survival [K] per power under the sampled rule, and the greedy-rule survival of the target's greedy chain."""
    model, positions = adapter.model, block_size - 1
    generator = torch.Generator(device=adapter.device).manual_seed(seed)
    records = []
    for index, (prompt, continuation) in enumerate(zip(prompts, continuations)):
        sequence = list(prompt) + list(continuation)
        cache = context_cache(model, sequence)
        for offset in range(0, len(continuation), anchor_stride):
            target = AnchorTarget(model, cache, sequence[: len(prompt) + offset], temperature=temperature,
                                  positions=positions)
            survival = block_parallel_survival(target.rollout, target.along, rollouts=rollouts, drafts=drafts,
                                               generator=generator, powers=powers)
            _, chain = target.rollout(1, greedy=True)
            records.append({"prompt": index, "sampled": {b: s.mean(dim=0).cpu() for b, s in survival.items()},
                            "greedy": torch.cumprod(chain[0].max(dim=-1).values, dim=0).cpu()})
    return records


def summarize(survivals: torch.Tensor, prompt_of: list[int]) -> dict:
    """tau = 1 + sum_k S_k per anchor, its mean and standard errors across anchors and across prompts' means, and the
    mean survival S_k and conditional acceptance S_k / S_{k-1} per block position."""
    taus = 1.0 + survivals.sum(dim=1).double().numpy()
    prompts = sorted(set(prompt_of))
    means = np.array([taus[[i for i, p in enumerate(prompt_of) if p == q]].mean() for q in prompts])
    survival = survivals.double().mean(dim=0).numpy()
    previous = np.concatenate([[1.0], survival[:-1]])

    def error(values: np.ndarray) -> float | None:
        return round(float(values.std(ddof=1) / np.sqrt(len(values))), 4) if len(values) > 1 else None

    return {"tau": round(float(taus.mean()), 4), "se_anchors": error(taus), "se_prompts": error(means),
            "anchors": len(taus), "prompts": len(prompts),
            "survival": [round(float(s), 4) for s in survival],
            "conditional_acceptance": [round(float(s / p), 4) if p > 0 else None for s, p in zip(survival, previous)]}


def sampled_rule_ceiling(records: list[dict]) -> dict:
    """The sampled-rule summary per power (`marginal` for power 1) and the greedy rule's on the same anchors."""
    prompt_of = [r["prompt"] for r in records]
    result = {("marginal" if b == 1.0 else f"marginal^{b:g}"):
              summarize(torch.stack([r["sampled"][b] for r in records]), prompt_of) for b in records[0]["sampled"]}
    result["greedy_rule_same_anchors"] = summarize(torch.stack([r["greedy"] for r in records]), prompt_of)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rules", nargs="+", choices=("greedy", "sampled"), default=["greedy", "sampled"])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0])
    parser.add_argument("--limit", type=int, default=16, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--anchor-stride", type=int, default=8, help="sampled rule: tokens between anchors")
    parser.add_argument("--rollouts", type=int, default=32, help="sampled rule: target rollouts per anchor (m_k)")
    parser.add_argument("--drafts", type=int, default=16, help="sampled rule: draft blocks verified per anchor")
    parser.add_argument("--sharpen", type=float, nargs="+", default=[1.0],
                        help="sampled rule: also score q_k ~ m_k^b for these b (1: the marginal)")
    parser.add_argument("--seed", type=int, default=0, help="sampled rule: rollouts and drafts")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    began = time.perf_counter()
    adapter = load_target("smollm2", device=args.device)
    specs = {name: {"source": name, "limit": args.limit} for name in ("humaneval", "mtbench", "gsm8k")}
    prompt_sets, _, _ = load_prompt_sets(adapter, specs, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    stops = adapter.stop_token_ids()
    powers = tuple(dict.fromkeys([1.0, *args.sharpen]))
    rules = {"greedy": "greedy drafts (vLLM, SGLang), perfect drafter = the target",
             "sampled": "sampled drafts, rejection sampling; block-parallel drafter q_k = the target's marginal m_k"}
    result: dict = {"target": "smollm2", "limit": args.limit, "max_new_tokens": args.max_new_tokens,
                    "block_size": args.block_size, "rules": {r: rules[r] for r in args.rules}, "sets": {}}
    if "sampled" in args.rules:
        result["sampled_rule_settings"] = {"anchor_stride": args.anchor_stride, "rollouts": args.rollouts,
                                           "drafts": args.drafts, "sharpen": list(powers), "seed": args.seed}
    for name, prompts in prompt_sets.items():
        rows = result["sets"][name] = {}
        if "greedy" in args.rules:
            greedy = sampled_continuations(adapter, prompts, max_new_tokens=args.max_new_tokens,
                                           stop_token_ids=stops, temperature=0.0, seed=0,
                                           batch_size=args.batch_size, engine="hf")
        for temperature in args.temperatures:
            sampled = sampled_continuations(adapter, prompts, max_new_tokens=args.max_new_tokens,
                                            stop_token_ids=stops, temperature=temperature, seed=0,
                                            batch_size=args.batch_size, engine="hf")
            row = rows[f"T={temperature}"] = {}
            if "greedy" in args.rules:
                common = dict(temperature=temperature, max_new_tokens=args.max_new_tokens,
                              block_size=args.block_size, batch_size=args.batch_size)
                row["greedy"] = {
                    "sampled_path": ceiling_tau(adapter, prompts, sampled, path_temperature=temperature, **common),
                    "greedy_path": ceiling_tau(adapter, prompts, greedy, path_temperature=0.0, **common)}
            if "sampled" in args.rules:
                records = anchor_records(adapter, prompts, sampled, temperature=temperature,
                                         block_size=args.block_size, anchor_stride=args.anchor_stride,
                                         rollouts=args.rollouts, drafts=args.drafts, powers=powers, seed=args.seed)
                row["sampled"] = sampled_rule_ceiling(records)
            row["seconds_since_start"] = round(time.perf_counter() - began, 1)
            print(name, temperature, json.dumps(row), file=sys.stderr, flush=True)
    result["seconds"] = round(time.perf_counter() - began, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
