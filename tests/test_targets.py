"""Target adapters: registry dispatch, dtype rules, loading errors, HF checkpoints, features vs logits."""

from __future__ import annotations

import pytest
import torch

from dflash.models.targets import (
    TARGET_ADAPTERS,
    TargetAdapter,
    adapter_class,
    build_tiny_target,
    load_target,
    resolve_dtype,
)
from dflash.models.targets.dense import DenseTargetAdapter
from dflash.models.targets.hybrid import HybridTargetAdapter
from dflash.models.targets.tiny import BUILTIN_SPECIAL_TOKENS, TINY_FAMILIES, build_builtin_tokenizer
from tests.test_targets_generic import GENERIC

EXPECTED = {
    "llama": ("llama", DenseTargetAdapter),
    "qwen3": ("qwen3", DenseTargetAdapter),
    "mistral": ("mistral", DenseTargetAdapter),
    "qwen3_5": ("qwen3_5_text", HybridTargetAdapter),
    "qwen3_5_moe": ("qwen3_5_moe_text", HybridTargetAdapter),
    "qwen3_next": ("qwen3_next", HybridTargetAdapter),
}


@pytest.fixture(scope="module")
def llama():
    return build_tiny_target("llama", seed=0, tokenizer="builtin")


def test_every_tiny_family_is_covered():
    assert set(EXPECTED) | set(GENERIC) == set(TINY_FAMILIES) and not set(EXPECTED) & set(GENERIC)


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_registry_dispatch_and_tiny_families(family):
    model_type, cls = EXPECTED[family]
    adapter = load_target("tiny", tiny={"family": family, "seed": 1, "tokenizer": "builtin", "num_hidden_layers": 4})
    assert type(adapter) is cls and adapter_class(model_type) is cls and TARGET_ADAPTERS[model_type] is cls
    assert adapter.model_type == model_type
    assert adapter.num_layers == 4 and len(adapter.decoder_layers()) == 4
    assert adapter.hidden_size == 64 and adapter.dtype == torch.float32 and adapter.device.type == "cpu"
    assert adapter.vocab_size >= len(adapter.tokenizer)
    assert adapter.lm_head_weight().shape == (adapter.vocab_size, adapter.hidden_size)
    assert not adapter.model.training
    assert not any(p.requires_grad for p in adapter.model.parameters())
    ids = torch.tensor([adapter.chat_ids([{"role": "user", "content": "hi"}])])
    features = adapter.capture(ids, None, [0, 2])
    assert features.shape == (1, ids.shape[1], 2 * adapter.hidden_size)
    assert torch.isfinite(features).all() and features.std() > 0


def test_unknown_family_and_model_type():
    with pytest.raises(ValueError, match="no target adapter for model_type 'gpt_neo'"):
        adapter_class("gpt_neo")
    with pytest.raises(ValueError, match="unknown tiny target family 'bert'"):
        build_tiny_target("bert")
    with pytest.raises(ValueError, match="unknown target kind 'onnx'"):
        load_target("onnx")


@pytest.mark.parametrize("dtype", ["float16", "fp16", torch.float16])
def test_float16_is_rejected(dtype):
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype(dtype, "cpu")
    with pytest.raises(ValueError, match="float16"):
        load_target("tiny", dtype=dtype, tiny={"family": "llama", "tokenizer": "builtin"})


def test_dtype_resolution():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        resolve_dtype("int8", "cpu")


def test_bfloat16_target_on_cpu():
    adapter = load_target("tiny", dtype="bfloat16", tiny={"family": "qwen3_5", "tokenizer": "builtin"})
    assert adapter.dtype == torch.bfloat16
    features = adapter.capture(torch.tensor([[5, 6, 7]]), None, [1])
    assert features.dtype == torch.bfloat16


def test_missing_hf_path_is_named(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(FileNotFoundError, match="no-such-checkpoint"):
        load_target("hf", str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="a folder without config.json"):
        load_target("hf", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="needs path"):
        load_target("hf")


def test_hf_checkpoint_round_trip(tmp_path, llama):
    llama.model.save_pretrained(tmp_path)
    llama.tokenizer.save_pretrained(tmp_path)
    loaded = load_target("hf", str(tmp_path))
    assert type(loaded) is DenseTargetAdapter
    ids = torch.tensor([llama.chat_ids([{"role": "user", "content": "round trip"}])])
    logits, features = loaded.forward_with_features(ids, None, [3])
    ref_logits, ref_features = llama.forward_with_features(ids, None, [3])
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(features, ref_features)
    assert loaded.chat_ids([{"role": "user", "content": "x"}]) == llama.chat_ids([{"role": "user", "content": "x"}])


def test_multimodal_qwen3_5_checkpoint_loads_text_only(tmp_path):
    """A Qwen3.5 checkpoint saved by the VLM class (model.language_model.* keys) loads as the text-only LM."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16,
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    vlm = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    vlm.save_pretrained(tmp_path)
    build_builtin_tokenizer().save_pretrained(tmp_path)
    adapter = load_target("hf", str(tmp_path))
    assert type(adapter) is HybridTargetAdapter and adapter.model_type == "qwen3_5_text"
    assert adapter.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    ids = torch.tensor([[5, 9, 44, 200, 31, 7]])
    with torch.no_grad():
        states = vlm.model.language_model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(adapter.capture(ids, None, [0, 2]), torch.cat([states[1], states[3]], dim=-1))


def test_forward_with_features_matches_capture_and_logits(llama):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0]])
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]])
    logits, features = llama.forward_with_features(ids, mask, [5, 1, 7])
    real = mask.bool()  # capture leaves padded positions unspecified
    torch.testing.assert_close(features[real], llama.capture(ids, mask, [5, 1, 7])[real])
    with torch.no_grad():
        reference = llama.model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, reference)
    assert logits.shape == (2, 6, llama.vocab_size)
    # Tap on the last layer: the hook sees the pre-norm output, HF's last hidden state is post-norm.
    with torch.no_grad():
        last = llama.model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    pre_norm = features[..., 2 * llama.hidden_size:]
    torch.testing.assert_close(llama.model.model.norm(pre_norm), last)


def test_one_forward_behind_the_capture_variants(llama):
    """capture, capture_with_final and forward_with_features are TargetAdapter.forward's three outputs; the hook of
    the deepest tap ends a "features" forward (later layers never run), and every hook is gone afterwards."""
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    features, none = llama.forward(ids, mask, [2, 0])
    assert none is None and torch.equal(features, llama.capture(ids, mask, [2, 0]))
    with_final = llama.forward(ids, mask, [2, 0], output="final")
    assert all(torch.equal(a, b) for a, b in zip(with_final, llama.capture_with_final(ids, mask, [2, 0])))
    features, logits = llama.forward(ids, mask, [2, 0], output="logits")
    assert all(torch.equal(a, b) for a, b in zip((logits, features), llama.forward_with_features(ids, mask, [2, 0])))
    modules = [*llama.decoder_layers(), llama.final_norm()]
    hooks = [len(module._forward_hooks) for module in modules]  # transformers may keep hooks of its own
    ran = []
    later = llama.decoder_layers()[3].register_forward_hook(lambda *_: ran.append(3))
    try:
        llama.forward(ids, mask, [2, 0])
    finally:
        later.remove()
    assert ran == []
    assert [len(module._forward_hooks) for module in modules] == hooks
    with pytest.raises(ValueError, match="output must be one of"):
        llama.forward(ids, mask, [2], output="hidden")
    # A forward with a cache (live decoding's CachedTarget) runs the whole model: it returns logits only.
    with pytest.raises(ValueError, match="a forward with a cache returns logits"):
        llama.forward(ids, mask, [2], output="features", cache=object())
    with pytest.raises(ValueError, match="layer_ids is empty"):
        llama.forward(ids, mask, [], output="logits")


def test_features_can_feed_autograd(llama):
    """Captured features are plain tensors (no inference mode): a trainable layer on top can backpropagate."""
    features = llama.capture(torch.tensor([[5, 6, 7]]), None, [1, 2])
    fc = torch.nn.Linear(features.shape[-1], 8)
    fc(features).sum().backward()
    assert fc.weight.grad is not None


def test_embeddings_and_head(llama):
    assert isinstance(llama.embed_tokens(), torch.nn.Embedding)
    # The SmolLM-like tiny llama ties its head to the embedding; Qwen3 does not.
    assert llama.lm_head_weight().data_ptr() == llama.embed_tokens().weight.data_ptr()
    qwen3 = build_tiny_target("qwen3", tokenizer="builtin")
    assert qwen3.lm_head_weight().data_ptr() != qwen3.embed_tokens().weight.data_ptr()


def test_tiny_is_deterministic_per_seed():
    a = build_tiny_target("qwen3_5", seed=3, tokenizer="builtin")
    b = build_tiny_target("qwen3_5", seed=3, tokenizer="builtin")
    c = build_tiny_target("qwen3_5", seed=4, tokenizer="builtin")
    for (name, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.embed_tokens().weight, c.embed_tokens().weight)


def test_tiny_overrides_and_vocab_guard():
    adapter = build_tiny_target("llama", tokenizer="builtin", num_hidden_layers=3, hidden_size=32, head_dim=8)
    assert adapter.num_layers == 3 and adapter.hidden_size == 32
    with pytest.raises(ValueError, match="vocab_size 100 is smaller"):
        build_tiny_target("llama", tokenizer="builtin", vocab_size=100)


def test_builtin_tokenizer_chat_and_stop_tokens(llama):
    tok = llama.tokenizer
    text = "Grüße, 世界!\n\tok"
    assert tok.decode(tok(text)["input_ids"]) == text
    ids = llama.chat_ids([{"role": "user", "content": "Hello"}])
    assert tok.decode(ids) == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.pad_token_id is not None
    assert tok.convert_tokens_to_ids("<|im_end|>") in llama.stop_token_ids()
    assert llama.stop_token_ids()[0] == tok.eos_token_id
    mask_id = tok.convert_tokens_to_ids("<|mask|>")
    assert mask_id < llama.vocab_size
    assert min(tok("plain text <|mask")["input_ids"]) >= len(BUILTIN_SPECIAL_TOKENS)  # bytes only


def test_adapter_needs_family_layout(llama):
    with pytest.raises(NotImplementedError):
        TargetAdapter(llama.model, llama.tokenizer)


def test_a_host_mask_goes_to_the_inputs_device_only_where_a_forward_reads_it():
    """TargetAdapter.forward checks a host mask on the host (a check of a GPU mask waits for the GPU) and hands
    `beside`'s copy to the layers; shown with the meta device standing in for the GPU."""
    from dflash.models.targets.base import beside

    mask, ids = torch.ones(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)
    assert beside(mask, ids) is mask and beside(None, ids.to("meta")) is None
    moved = beside(mask, ids.to("meta"))
    assert moved.device.type == "meta" and moved.shape == mask.shape
