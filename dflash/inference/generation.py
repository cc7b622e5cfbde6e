"""Plain model.generate for the data stage: neutral settings, seeded sampling, responses cut at the first stop
(token or text)."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from dflash.inference.keyed_sampling import KeyedSampling


def batch_seed(seed: int, ids: list[str]) -> int:
    """A sampling seed that depends only on the run seed and the prompts in the batch."""
    digest = hashlib.sha256(json.dumps([seed, ids]).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def generation_config(max_new_tokens: int, stop_ids: list[int], pad_id: int, temperature: float,
                      top_p: float) -> GenerationConfig:
    """Plain greedy (temperature 0) or temperature + top-p sampling.

    The knobs whose global defaults are not neutral (top_k 50) and those a checkpoint's generation_config.json
    commonly sets are pinned to neutral; generate() fills the rest from the model's generation_config, which
    `model_defaults_hidden` (used by hf_generate) blanks: the responses must be the target's own distribution.
    """
    neutral = {"num_beams": 1, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_length": 0}
    if temperature > 0:
        neutral.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0, min_p=0.0, typical_p=1.0,
                       epsilon_cutoff=0.0, eta_cutoff=0.0)
    else:
        neutral.update(do_sample=False)
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad_id,
                            use_cache=True, **neutral)


def cut_response(tokens: list[int], stop_ids: set[int], budget: int, stop_strings: Sequence[str] = (),
                 tokenizer: Any = None) -> tuple[list[int], str]:
    """Response up to and including the first stop token, at most `budget` tokens, and ended before the first of
    `stop_strings` (decoded with `tokenizer`) it holds; finish "stop" when a stop token or string ended it."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            tokens = tokens[: i + 1]
            break
    if len(tokens) > budget:
        tokens = tokens[:budget]
    tokens, at_string = cut_at_stop_strings(tokens, stop_strings, tokenizer)
    return tokens, ("stop" if at_string or (tokens and tokens[-1] in stop_ids) else "length")


def cut_at_stop_strings(tokens: list[int], stop_strings: Sequence[str], tokenizer: Any) -> tuple[list[int], bool]:
    """The longest prefix of `tokens` whose text ends before the first stop string in their text, and whether one
    was there. A token that holds the start of the stop string goes with it."""
    if not stop_strings or not tokens:
        return tokens, False
    text = tokenizer.decode(tokens)
    found = [at for at in (text.find(stop) for stop in stop_strings) if at >= 0]
    if not found:
        return tokens, False
    end = min(found)
    low, high = 0, len(tokens)  # the answer: the most tokens whose text is at most `end` characters long
    while low < high:
        middle = (low + high + 1) // 2
        # A byte-fallback tokenizer (Gemma, Llama 2) spells a rare character in byte tokens, and a prefix that ends
        # inside one decodes to a replacement character per byte so far: lengths with them would not grow with the
        # prefix (the search could stop early, or inside the character). Without them they do.
        if len(tokenizer.decode(tokens[:middle]).rstrip("\ufffd")) <= end:
            low = middle
        else:
            high = middle - 1
    return tokens[:low], True


@contextlib.contextmanager
def model_defaults_hidden(model: Any) -> Iterator[None]:
    """`model.generation_config` blank inside the block, restored after it."""
    # generate() fills every field its config leaves unset from model.generation_config (a checkpoint's
    # generation_config.json: suppress_tokens, min_new_tokens, bad_words_ids, a repetition penalty ...), each a
    # logits processor that would change what is drawn or picked.
    saved, model.generation_config = model.generation_config, GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def hf_generate(adapter: Any, batch: list[list[int]], config: GenerationConfig, pad_id: int, seed: int,
                streamer: BaseStreamer | None = None, keys: Sequence[str] | None = None) -> list[list[int]]:
    """New tokens for each left-padded prompt of the batch (one call of model.generate); `streamer` sees every
    step's tokens (for a progress bar). A sampling `config` with `keys` (one stream key a prompt, keyed_sampling.py)
    draws each prompt's tokens from its own stream, so its answer does not depend on the batch; without keys, from
    the global RNG seeded with `seed` (restored afterwards)."""
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids):] = 1
    device = torch.device(adapter.device)
    # Passed only when given: generate's callers (and stand-ins for it) need not know the keywords otherwise.
    extra: dict[str, Any] = {} if streamer is None else {"streamer": streamer}
    if keys is not None and config.do_sample:
        if len(keys) != len(batch):
            raise ValueError(f"{len(keys)} stream keys for {len(batch)} prompts")
        extra["logits_processor"] = LogitsProcessorList([KeyedSampling(
            keys, width, config.max_new_tokens, config.temperature, config.top_p, device)])
        config = copy.deepcopy(config)  # greedy, its warpers off: the processor has chosen the token
        config.do_sample, config.temperature, config.top_p = False, 1.0, 1.0
        # Unset rather than neutral: generate warns about sampling flags on a greedy config otherwise.
        config.top_k = config.min_p = config.typical_p = config.epsilon_cutoff = config.eta_cutoff = None
    # Sampling without keys draws from the global RNG inside generate: seed it per batch and restore it afterwards.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.inference_mode(), \
            model_defaults_hidden(adapter.model):
        torch.manual_seed(seed)
        out = adapter.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                     generation_config=config, **extra)
    return out[:, width:].tolist()
