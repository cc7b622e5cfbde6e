"""Targets without a registry line: the generic adapter on tiny random models of several transformers families
(capture == hidden_states[L+1], the final state, the logits with the family's own transform, live decoding
lossless in fp32), and the refusal of families whose layers keep recurrent state, before any weight is read."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from dflash.eval.live import live_decode
from dflash.models.targets import UnsupportedTarget, adapter_for, build_tiny_target, wrap_model
from dflash.models.targets import generic
from dflash.models.targets.generic import GenericTargetAdapter
from dflash.models.targets.logit_transform import LogitTransform
from dflash.models.targets.tiny import build_builtin_tokenizer
from tests.schema_options import DRAFT_SAMPLING, LIVE_ENGINE

GENERIC = ["gemma2", "gemma3_text", "granite", "cohere", "phi3", "olmo2", "stablelm", "glm4", "gpt_oss",
           "deepseek_v3"]
# Transforms strong enough to matter on random weights (the defaults barely touch logits near 0).
STRONG = {"gemma2": {"final_logit_softcapping": 0.5}, "gemma3_text": {"final_logit_softcapping": 0.5},
          "granite": {"logits_scaling": 8.0}, "cohere": {"logit_scale": 4.0}}
_SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Families whose layers keep recurrent or convolution state, and no adapter that restores it.
STATEFUL = {
    "mamba": ("MambaConfig", {}),
    "jamba": ("JambaConfig", dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, num_experts=2)),
    "falcon_h1": ("FalconH1Config", {}),
    "bamba": ("BambaConfig", {}),
    "lfm2": ("Lfm2Config", dict(layer_types=["conv", "full_attention", "conv", "full_attention"])),
}


def tiny(family: str, **overrides):
    return build_tiny_target(family, seed=0, tokenizer="builtin", **{**STRONG.get(family, {}), **overrides})


def chat(adapter, text="Write a haiku about the sea, please, and then explain it."):
    return torch.tensor([adapter.chat_ids([{"role": "user", "content": text}])])


@pytest.mark.parametrize("family", GENERIC)
def test_capture_final_state_and_logits_equal_hf(family):
    adapter = tiny(family)
    assert type(adapter) is GenericTargetAdapter and adapter.num_layers == 8
    ids = chat(adapter)
    assert ids.shape[1] > 16  # longer than the sliding windows (8) of gemma2, gemma3_text and gpt_oss
    taps = [0, 3, 6]
    with torch.no_grad():
        out = adapter.model(input_ids=ids, output_hidden_states=True)
    features = adapter.capture(ids, None, taps)
    expected = torch.cat([out.hidden_states[i + 1] for i in taps], dim=-1)
    torch.testing.assert_close(features, expected, rtol=0, atol=0)
    features, final = adapter.capture_with_final(ids, None, taps)
    torch.testing.assert_close(final, out.hidden_states[-1], rtol=0, atol=0)
    logits = adapter.logit_transform(final @ adapter.lm_head_weight().T)
    torch.testing.assert_close(logits, out.logits, rtol=1e-5, atol=1e-5)
    raw = final @ adapter.lm_head_weight().T
    assert (family in STRONG) == (not torch.allclose(raw, out.logits, atol=1e-3))


def test_logit_transforms_read_from_the_configs():
    assert tiny("gemma2").logit_transform == LogitTransform(softcap=0.5)
    assert tiny("granite").logit_transform == LogitTransform(scale=1 / 8)
    assert tiny("cohere").logit_transform == LogitTransform(scale=4.0)
    assert tiny("phi3").logit_transform.identity and not tiny("phi3").model.config.tie_word_embeddings
    assert LogitTransform.from_metadata(LogitTransform(0.25, 30.0).metadata()) == LogitTransform(0.25, 30.0)
    assert LogitTransform().metadata() == {} and LogitTransform.from_metadata(None).identity


def test_a_target_whose_logits_differ_from_its_transform_is_refused(monkeypatch):
    monkeypatch.setattr("dflash.models.targets.base.logit_transform_of", lambda config: LogitTransform())
    with pytest.raises(UnsupportedTarget, match=r"'gemma2' \(Gemma2ForCausalLM\) makes its logits in a way"):
        tiny("gemma2")


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss", "deepseek_v3", "granite"])
def test_live_decoding_is_lossless(family, make_drafter):
    assert_live_decoding_lossless(tiny(family), make_drafter)


def assert_live_decoding_lossless(adapter, make_drafter, new_tokens=20):
    """Live decoding with a random drafter gives the target's own greedy continuation."""
    drafter = make_drafter(adapter, block_size=5)
    prompt = chat(adapter, "What is two plus two?")[0].tolist()
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            tokens.append(int(adapter.model(torch.tensor([tokens])).logits[0, -1].argmax()))
    result = live_decode(drafter, adapter, prompt, max_new_tokens=new_tokens, stop_token_ids=[],
                         target_engine=LIVE_ENGINE, draft_sampling=DRAFT_SAMPLING)
    assert result.continuation == tokens[len(prompt):]


@pytest.mark.parametrize("family", sorted(STATEFUL))
def test_stateful_families_are_refused_by_name_before_loading(family):
    config_name, extra = STATEFUL[family]
    config = getattr(transformers, config_name)(**{**_SMALL, **extra})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedTarget, match=rf"target '{family}' \(.*\) keeps recurrent state in its layers "
                                                r"\(.+\), which speculative decoding must restore"):
        adapter_for(model)
    assert "\n" not in generic.unsupported_reason(model)


def test_the_refusal_names_what_is_missing():
    config = transformers.LlamaConfig(**_SMALL)
    model = AutoModelForCausalLM.from_config(config)
    model.model.norm = None
    model.config.model_type = "llama_variant"
    with pytest.raises(UnsupportedTarget, match=r"'llama_variant' \(LlamaForCausalLM\): LlamaModel has no final "
                                                r"norm"):
        wrap_model(model, build_builtin_tokenizer())
    model.model.layers = model.model.layers[:2]
    assert "has no list of 4 decoder layers" in generic.unsupported_reason(model)


@pytest.mark.parametrize("family", GENERIC)
def test_packed_capture_equals_each_sequence_alone(family):
    """Sinks (gpt_oss) and soft-capped attention scores (gemma2) are beyond the packed kernels, and StableLM's
    layers do not pass the row's offsets on to attention: such targets are captured as a padded batch
    (packing_problem), the others packed; both equal each sequence captured alone."""
    adapter = tiny(family)
    texts = ["Hi", "A much longer question about the sea, the sky and the wind.", "What is 2 + 2?"]
    sequences = [adapter.chat_ids([{"role": "user", "content": t}]) for t in texts]
    packed = adapter.capture_packed(torch.tensor(sum(sequences, [])), [len(s) for s in sequences], [1, 5])
    alone = torch.cat([adapter.capture(torch.tensor([s]), None, [1, 5])[0] for s in sequences])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert (adapter.packing_problem() is not None) == (family in ("gemma2", "gpt_oss", "stablelm"))


def llama4_text(tok):
    tokens = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config = transformers.Llama4TextConfig(**{**_SMALL, **tokens, "num_hidden_layers": 8}, intermediate_size_mlp=128,
                                           num_local_experts=2, num_experts_per_tok=1, attention_chunk_size=8)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def test_llama4_text_is_taken_through_its_model_stack(make_drafter):
    """Llama4ForCausalLM.get_decoder() is the LM itself; its stack at `.model` is taken. Its chunked attention
    (chunks of 8, shorter than the sequences) is captured padded, and the static engines refuse it."""
    tok = build_builtin_tokenizer()
    adapter = wrap_model(llama4_text(tok), tok)
    assert type(adapter) is GenericTargetAdapter and adapter.text_model() is adapter.model.model
    ids = chat(adapter)
    with torch.no_grad():
        out = adapter.model(input_ids=ids, output_hidden_states=True)
    features, final = adapter.capture_with_final(ids, None, [0, 2])
    torch.testing.assert_close(features, torch.cat([out.hidden_states[1], out.hidden_states[3]], dim=-1),
                               rtol=0, atol=0)
    torch.testing.assert_close(final, out.hidden_states[-1], rtol=0, atol=0)
    sequences = [ids[0, :7].tolist(), ids[0].tolist()]
    packed = adapter.capture_packed(torch.tensor(sum(sequences, [])), [len(s) for s in sequences], [1, 3])
    alone = torch.cat([adapter.capture(torch.tensor([s]), None, [1, 3])[0] for s in sequences])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert "chunked" in adapter.packing_problem()
    assert "llama4_text" in adapter.static_layout_problem()
    assert_live_decoding_lossless(adapter, make_drafter)


def gemma3n_text_config():
    return transformers.Gemma3nTextConfig(**_SMALL, laurel_rank=8, hidden_size_per_layer_input=8,
                                          vocab_size_per_layer_input=320, num_kv_shared_layers=0,
                                          layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                          activation_sparsity_pattern=[0.0] * 4, altup_num_inputs=2)


def test_layers_that_output_stacked_streams_are_refused(monkeypatch):
    """Gemma 3n's decoder layers output AltUp's streams [altup, b, T, H]: refused by its config before loading, and
    by the adapter's own forward when a family's layers output any other shape than [b, T, H]."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(gemma3n_text_config())
    with pytest.raises(UnsupportedTarget, match=r"'gemma3n_text' \(Gemma3nForCausalLM\) runs AltUp: its decoder "
                                                r"layers output 2 stacked streams"):
        adapter_for(model)
    monkeypatch.setattr(generic, "unsupported_reason", lambda model: None)
    model = AutoModelForCausalLM.from_config(gemma3n_text_config(), dtype=torch.float32)
    with pytest.raises(UnsupportedTarget, match=r"its decoder layers output a tensor of shape \(2, 1, 8, 64\), not "
                                                r"the \[batch, tokens, hidden\] \(1, 8, 64\)"):
        GenericTargetAdapter(model, build_builtin_tokenizer())
