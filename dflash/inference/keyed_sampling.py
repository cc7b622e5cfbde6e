"""Sampling that depends on the prompt alone: each prompt draws its tokens from its own uniform stream, one draw per
new-token index, so its answer is the same whatever batch, row or run decodes it (a resumed data stage included).

`sample_tokens` turns a row's draw into a token by inverse CDF over softmax(logits / T) cut to its top-p nucleus;
`prompt_draws` is a prompt's stream. The static engine (static_decode.py) runs them inside its decode step;
`KeyedSampling` runs them as a logits processor of a greedy Hugging Face `generate` (the hf engine), which then
takes the chosen token as its argmax. Both engines key a prompt the same way (`prompt_key`), so at T > 0 they draw
the same answer for it, up to the rounding of their logits. The CDF and the draws are float64: a float32 running
sum over a vocabulary rounds away every token below half its last place (~3e-8 past 0.5), which could then never
be drawn.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from transformers import LogitsProcessor


def prompt_key(seed: int) -> str:
    """The stream key of a prompt whose sampling seed is `seed` (generation.batch_seed of the run seed and its id)."""
    return f"prompt:{int(seed)}"


def prompt_draws(key: str, count: int) -> torch.Tensor:
    """The uniform draws [count] of the prompt whose stream key is `key`, one per new-token index: its sampling
    stream, whichever row or batch it decodes in."""
    digest = hashlib.sha256(key.encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return torch.rand(count, generator=generator, dtype=torch.float64)  # 53 bits: every float64 CDF step reachable


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float, uniform: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from softmax(logits / temperature) cut to its top-p nucleus, by inverse CDF.

    `uniform` [b] holds one U[0, 1) draw per row (float64, prompt_draws); no randomness is drawn here, so the
    function can live in a CUDA graph. The nucleus is the smallest set of most likely tokens whose mass reaches
    top_p (as HF's top-p).
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)
        probs = probs * ((probs.cumsum(dim=-1, dtype=torch.float64) - probs) < top_p)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # module docstring: float32 sums lose the tail tokens
    threshold = uniform[:, None].double() * cdf[:, -1:]
    # The first token whose cdf passes the threshold: `<=` skips tokens of zero mass, even for a draw of exactly 0.
    choice = (cdf <= threshold).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    return (order.gather(-1, choice) if top_p < 1.0 else choice).squeeze(-1)


class KeyedSampling(LogitsProcessor):
    """The tokens of a greedy `generate` drawn at `temperature` / `top_p` from each row's stream: row r of a batch
    whose prompts are left-padded to `width` draws new token k with prompt_draws(keys[r])[k]; the chosen token keeps
    a score of 0 and every other one -inf, so generate's argmax takes it (and its own warpers stay off)."""

    def __init__(self, keys: Sequence[str], width: int, max_new_tokens: int, temperature: float, top_p: float,
                 device: torch.device | str) -> None:
        if temperature <= 0:
            raise ValueError(f"keyed sampling needs a temperature > 0, got {temperature}")
        self.uniform = torch.stack([prompt_draws(key, max_new_tokens) for key in keys]).to(device)
        self.width, self.temperature, self.top_p = width, temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        index = input_ids.shape[1] - self.width  # the new token's index, the same in every row of the batch
        chosen = sample_tokens(scores, self.temperature, self.top_p, self.uniform[:, index])
        return torch.full_like(scores, float("-inf")).scatter_(1, chosen[:, None], 0.0)
