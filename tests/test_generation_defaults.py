"""Sampled target continuations (hf_generate: the T > 0 replay estimate, the sampled held-out set, regeneration)
are drawn from softmax(z / T) alone: nothing of the model's own generation_config reaches them."""

from __future__ import annotations

import copy

from transformers import GenerationConfig

from dflash.eval.replay_estimate import sampled_continuations


def test_sampled_continuations_ignore_the_models_generation_config(tiny_target):
    adapter = tiny_target("qwen3")
    model = adapter.model
    prompt = adapter.chat_ids([{"role": "user", "content": "Name three colours."}])
    options = dict(max_new_tokens=12, stop_token_ids=adapter.stop_token_ids(), temperature=1.0, seed=7,
                   batch_size=1, engine="hf")
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        (blank,) = sampled_continuations(adapter, [prompt], **options)
    finally:
        model.generation_config = saved
    # What a checkpoint's generation_config.json may set: each would change the draw (the tokens drawn above
    # suppressed, the stop token held back, ...).
    own = copy.deepcopy(saved)
    own.suppress_tokens = sorted(set(blank))
    own.begin_suppress_tokens = blank[:1]
    own.bad_words_ids = [[token] for token in blank[:2]]
    own.min_new_tokens = 12
    own.renormalize_logits = True
    model.generation_config = own
    try:
        (drawn,) = sampled_continuations(adapter, [prompt], **options)
        assert model.generation_config is own  # restored after the call
    finally:
        model.generation_config = saved
    assert drawn == blank
