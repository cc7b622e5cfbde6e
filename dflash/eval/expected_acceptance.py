"""Expected acceptance at a temperature T > 0 along stored target passes: tau with no draw in the acceptance.

A DFlash block's drafts are predicted in parallel, so the drafter's distribution q_k at block position k depends
only on the context up to the anchor, never on the drafts before it. Along a stored pass s (prompt + a
continuation) the target's distribution p_k = softmax(z_k / T) at block position k is known wherever the drafts
before k equal the stored tokens (z_k: the target's logits after the stored prefix, read as its logit transform of
final hidden state @ lm_head^T, as the loss reads them; the drafter's logits go through the same transform).
With r the distribution the stored token was drawn from (1 for a greedy pass; p_{T_path}(s_j) for a pass sampled
at T_path), let

    f_j = P(draft j accepted and equal to s_j) / r(s_j),   beta_k = P(draft k accepted | drafts < k accepted, prefix)

Under the serving engines' rule (`greedy` drafts d_k = argmax q_k, accepted with probability p_k(d_k))
f_j = [d_j = s_j] p_j(d_j) / r(s_j) and beta_k = p_k(d_k); under the `sampled` rule (d_k drawn from q_k, accepted
with min(1, p/q)) f_j = min(p_j(s_j), q_j(s_j)) / r(s_j) and beta_k = sum_x min(p_k(x), q_k(x)).

On a pass sampled at T itself (T_path = T) the survival of an anchor is S_k = prod_{j<=k} f_j, and the walk below
is exact in expectation over the passes. Rejection sampling commits tokens distributed as the target's own at T,
so a pass sampled at T is a live decode's committed text, and given that text draft j is accepted with probability
P(accepted, token s_j) / P(token s_j) = f_j (r = p_T), independently of the other positions: [d_j = s_j] for
greedy drafts (accepted exactly where the draft is the token the target's draw kept), min(1, q/p) for sampled ones.
The only noise left is the pass's own draw, the same as a live decode's.

On any other pass (a greedy pass, or one sampled at another temperature) S_k = prod_{j<k} f_j * beta_k: on a
greedy pass the exact product of acceptance probabilities up to the first draft that leaves the stored tokens and 0
after it (a lower bound: what the target would say after a draft it did not write is not stored). There beta_k
counts a rejection at k while the walk goes on along s_k, so it is a score, not a prediction of live tau at T.
docs/eval.md has the rule.

Steps are then walked in expectation (`walk_expected`): from each anchor the step commits a + 1 tokens with
probability S_a - S_{a+1}, blocks shrinking near max_new_tokens and counted as the replay counts them (replay.py),
the next anchor lying further along the stored pass. tau = tokens / expected steps; at T -> 0 on the greedy pass
this is the greedy replay exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dflash.inference.sampling import DRAFT_SAMPLING
from dflash.models.targets.logit_transform import logits_from_hidden

# Elements of one [anchors, block positions, vocab] float32 tensor per chunk: bounds memory at 262k vocabularies.
CHUNK_ELEMENTS = 1 << 25


@dataclass
class ExpectedTrace:
    """One sequence's step records in expectation (sums over its steps, floats): what StepTrace counts."""

    steps: float = 0.0
    committed: float = 0.0
    accepted: float = 0.0
    drafted: float = 0.0
    hits: list[float] = field(default_factory=list)       # [B-1]: expected steps whose draft k was accepted
    eligible: list[float] = field(default_factory=list)   # [B-1]: expected steps that drafted position k
    histogram: list[float] = field(default_factory=list)  # [B+1]: expected steps committing c tokens


def check_rule(temperature: float, draft_sampling: str) -> None:
    """ValueError unless the estimate is defined: T > 0 and a known drafting rule."""
    if not temperature > 0:
        raise ValueError(f"the acceptance estimate needs a temperature > 0, got {temperature}")
    if draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING}, got {draft_sampling!r}")


def block_survival(draft_logits: torch.Tensor, target_logits: torch.Tensor, stored: torch.Tensor, *,
                   temperature: float, path_temperature: float, draft_sampling: str,
                   draft_temperature: float | None = None) -> torch.Tensor:
    """S_k [n, K] (k = 1..K) of n blocks (module docstring).

    draft_logits, target_logits [n, K, V]: the drafter's and the target's logits at block positions 1..K (the
    target's after the stored prefix); stored [n, K]: the stored tokens at those positions. draft_temperature
    (sampled drafts): q = softmax(draft logits / draft_temperature); None: `temperature`.
    """
    log_p = torch.log_softmax(target_logits.float() / temperature, dim=-1)
    stored = stored.to(log_p.device)[..., None]
    log_p_stored = log_p.gather(-1, stored).squeeze(-1)
    if path_temperature > 0:
        log_r = torch.log_softmax(target_logits.float() / path_temperature, dim=-1).gather(-1, stored).squeeze(-1)
    else:
        log_r = torch.zeros_like(log_p_stored)
    if draft_sampling == "greedy":
        drafts = draft_logits.argmax(dim=-1, keepdim=True).to(log_p.device)
        beta = log_p.gather(-1, drafts).squeeze(-1).exp()
        kept = (drafts == stored).squeeze(-1) * (log_p_stored - log_r).exp()
    else:
        log_q = torch.log_softmax(draft_logits.float().to(log_p.device) / (draft_temperature or temperature), dim=-1)
        beta = torch.minimum(log_p, log_q).exp().sum(dim=-1)
        kept = (torch.minimum(log_p_stored, log_q.gather(-1, stored).squeeze(-1)) - log_r).exp()
    if path_temperature == temperature:
        # The pass is what a live decode at T commits: walking it with the acceptance given its own tokens is exact
        # (module docstring). beta_k would count a rejection at k while the walk goes on along s_k.
        return torch.cumprod(kept, dim=1)
    before = torch.cumprod(torch.cat([torch.ones_like(kept[:, :1]), kept[:, :-1]], dim=1), dim=1)
    return before * beta


def walk_expected(survival: np.ndarray, prompt_len: int, end: int, max_length: int, block_size: int) -> ExpectedTrace:
    """Walk one sequence's steps in expectation; survival[i, k] = S_k of the anchor at prompt_len + i (k = 0..B-1,
    S_0 = 1, entries past the block's checkable drafts ignored). end: the stored pass's last position; max_length:
    prompt_len + max_new_tokens. Bookkeeping as replay_steps: committed min(a + 1, remaining), drafted `checkable`
    on the step that commits the last token, else size - 1."""
    trace = ExpectedTrace(hits=[0.0] * (block_size - 1), eligible=[0.0] * (block_size - 1),
                          histogram=[0.0] * (block_size + 1))
    reach = np.zeros(end - prompt_len + block_size + 1)
    reach[0] = 1.0
    hits, eligible, histogram = np.zeros(block_size - 1), np.zeros(block_size - 1), np.zeros(block_size + 1)
    for i in range(end - prompt_len):
        v = reach[i]
        if v == 0.0:
            continue
        start = prompt_len + i
        size, remaining = min(block_size, max_length - start), end - start
        checkable = min(size - 1, remaining)
        s = np.append(survival[i, : checkable + 1], 0.0)
        mass = s[:-1] - s[1:]  # P(accepted = a), a = 0..checkable
        committed = np.minimum(np.arange(checkable + 1) + 1, remaining)
        last = committed == remaining
        drafted = np.where(last, checkable, size - 1)
        trace.steps += v
        trace.accepted += v * float(mass @ np.arange(checkable + 1))
        trace.drafted += v * float(mass @ drafted)
        hits[:checkable] += v * s[1 : checkable + 1]
        # Every step drafts positions 1..checkable; those past it only when the step does not end the pass.
        eligible[:checkable] += v
        eligible[checkable : size - 1] += v * float(mass[~last].sum())
        np.add.at(histogram, committed, v * mass)
        np.add.at(reach, i + committed, v * mass)
    # An empty continuation (an answer that began with a stop string) ends at prompt_len - 1: no step, no token.
    trace.committed = float(max(end - prompt_len, 0))
    trace.hits, trace.eligible, trace.histogram = hits.tolist(), eligible.tolist(), histogram.tolist()
    return trace


def expected_metrics(traces: list[ExpectedTrace], block_size: int) -> dict[str, Any]:
    """acceptance_metrics' keys (metrics.py) from expected traces: the same definitions, in expectation."""
    steps = sum(t.steps for t in traces)
    accepted, drafted = sum(t.accepted for t in traces), sum(t.drafted for t in traces)
    per_prompt = [t.committed / t.steps for t in traces if t.steps > 0]
    per_position = []
    for k in range(block_size - 1):
        eligible = sum(t.eligible[k] for t in traces)
        per_position.append(sum(t.hits[k] for t in traces) / eligible if eligible > 0 else None)
    return {
        "tau": sum(t.committed for t in traces) / steps if steps > 0 else None,
        "tau_prompt_mean": sum(per_prompt) / len(per_prompt) if per_prompt else None,
        "acceptance_rate": accepted / drafted if drafted > 0 else None,
        "per_position": per_position,
        "committed_histogram": [sum(t.histogram[c] for t in traces) for c in range(block_size + 1)],
        "num_prompts": len(traces),
        "num_steps": steps,
        "num_tokens": round(sum(t.committed for t in traces)),  # every stored token is committed: an integer
        "num_accepted": accepted,
        "num_drafted": drafted,
    }


# The target's logit transform (dflash/models/targets/logit_transform.py): raw head logits -> logits; None: none.
Transform = Callable[[torch.Tensor], torch.Tensor]

# draft_logits(rows, starts, sizes) -> the drafter's logits [n, max size - 1, V] at block positions 1.. of blocks of
# `sizes` tokens anchored at `starts` of sequences `rows` (positions past a row's size are ignored).
DraftLogits = Callable[[list[int], list[int], list[int]], torch.Tensor]


def head_logits(hidden: Callable[[list[int], list[int], list[int]], torch.Tensor], head: torch.Tensor,
                transform: Transform | None = None) -> DraftLogits:
    """DraftLogits of a drafter whose block output is hidden(rows, starts, sizes) [n, max size, H]
    (DrafterProposer.hidden), read through the target's lm_head weight `head` [V, H] and logit `transform`."""
    def logits(rows: list[int], starts: list[int], sizes: list[int]) -> torch.Tensor:
        return logits_from_hidden(hidden(rows, starts, sizes)[:, 1:], head, transform)
    return logits


def expected_traces(draft_logits: DraftLogits, head: torch.Tensor, finals: list[torch.Tensor],
                    sequences: list[list[int]], prompt_lens: list[int], *, block_size: int, max_new_tokens: int,
                    temperature: float, path_temperature: float, draft_sampling: str,
                    transform: Transform | None = None, draft_temperature: float | None = None) -> list[ExpectedTrace]:
    """One ExpectedTrace per stored pass: every position of each continuation is drafted from as an anchor, in
    chunks of anchors whose [anchors, B-1, V] logits stay under CHUNK_ELEMENTS, then the steps are walked.

    head: the target's lm_head weight [V, H]; finals[i]: the target's final hidden states [len, H] along
    sequences[i] (prompt + continuation); path_temperature: what the continuation was drawn at (0: greedy);
    transform: the target's logit transform, applied to its logits here (draft_logits apply it to the drafter's);
    draft_temperature: what sampled drafts are drawn at (block_survival).
    """
    check_rule(temperature, draft_sampling)
    anchors = [(row, start) for row, (s, p) in enumerate(zip(sequences, prompt_lens)) for start in range(p, len(s) - 1)]
    survival = [np.zeros((max(len(s) - 1 - p, 0), block_size)) for s, p in zip(sequences, prompt_lens)]
    per_chunk = max(1, CHUNK_ELEMENTS // ((block_size - 1) * head.shape[0]))
    for first in range(0, len(anchors), per_chunk):
        chunk = anchors[first : first + per_chunk]
        rows, starts = [r for r, _ in chunk], [s for _, s in chunk]
        sizes = [min(block_size, prompt_lens[r] + max_new_tokens - s) for r, s in chunk]
        values = _chunk_survival(draft_logits(rows, starts, sizes), head, finals, sequences, rows, starts, transform,
                                 temperature=temperature, path_temperature=path_temperature,
                                 draft_sampling=draft_sampling, draft_temperature=draft_temperature)
        for (row, start), value in zip(chunk, values):
            survival[row][start - prompt_lens[row], 0] = 1.0
            survival[row][start - prompt_lens[row], 1 : 1 + value.shape[0]] = value
    return [walk_expected(surv, p, len(s) - 1, p + max_new_tokens, block_size)
            for surv, s, p in zip(survival, sequences, prompt_lens)]


def _chunk_survival(draft_logits: torch.Tensor, head: torch.Tensor, finals: list[torch.Tensor],
                    sequences: list[list[int]], rows: list[int], starts: list[int], transform: Transform | None,
                    **rule: Any) -> np.ndarray:
    """S_1..S_K [n, K] of the blocks anchored at `starts` of `rows` (positions past a pass's end are zeroed)."""
    n, width = draft_logits.shape[:2]
    device = head.device
    offsets = torch.arange(width)
    lengths = torch.tensor([len(sequences[r]) for r in rows])
    # Block position k (k = 1..K) predicts token start + k from the target's state at start + k - 1.
    position = torch.tensor(starts)[:, None] + offsets[None]
    inside = position + 1 < lengths[:, None]
    position = torch.minimum(position, lengths[:, None] - 2)
    states = torch.stack([finals[r][position[i].to(finals[r].device)].to(device) for i, r in enumerate(rows)])
    stored = torch.stack([torch.tensor(sequences[r])[position[i] + 1] for i, r in enumerate(rows)])
    target_logits = logits_from_hidden(states, head, transform)
    survival = block_survival(draft_logits.to(device), target_logits, stored, **rule).cpu().double()
    return (survival * inside.to(survival.dtype)).numpy().reshape(n, width)
