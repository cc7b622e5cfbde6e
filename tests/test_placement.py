"""Layer-wise placement of a target over several devices: device maps, loading across devices, errors.

CPU only: a map for GPUs is checked as data (every family, the Qwen3.6-27B shape on the meta device); loading
"across" ["cpu", "cpu"] runs the real accelerate dispatch with its hooks (kind "tiny": dispatch_model with
force_hooks) or from_pretrained with a device map (kind "hf"; transformers attaches no hooks to a CPU-only map).
That features computed on another GPU come back on the first one is only checked on a multi-GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from dflash.models.targets import TARGET_ADAPTERS, load_target
from dflash.models.targets.placement import (
    device_map_for,
    empty_model,
    gpus_per_worker,
    module_bytes,
    parse_devices,
    rank_devices,
    resolve_gpus_per_worker,
    split_layers,
    target_bytes,
)
from dflash.models.targets.tiny import build_builtin_tokenizer

SMALL = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
QWEN36_27B = dict(
    vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
    num_key_value_heads=4, head_dim=256, partial_rotary_factor=0.25, linear_num_key_heads=16,
    linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    full_attention_interval=4, tie_word_embeddings=False,
)
GPUS = ["cuda:0", "cuda:1", "cuda:2"]
IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0]])
MASK = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]])


def small_config(model_type: str):
    """A tiny config of a registered model_type; the VLM types (qwen3_5, qwen3_5_moe) get a vision tower too."""
    from transformers import AutoConfig

    if model_type in ("qwen3_5", "qwen3_5_moe"):
        return AutoConfig.for_model(model_type, text_config=SMALL, vision_config=VISION)
    return AutoConfig.for_model(model_type, **SMALL)


def check_map(model: torch.nn.Module, device_map: dict[str, str], devices: list[str]) -> None:
    """Every tensor covered once, layers whole, runs contiguous and in device order, bytes within one layer."""
    from dflash.models.targets.placement import _layout

    names = [n for n, _ in model.named_parameters(remove_duplicate=False)] + [n for n, _ in model.named_buffers()]
    for name in names:
        owners = [k for k in device_map if name == k or name.startswith(k + ".")]
        assert len(owners) == 1, (name, owners)
    layers, _ = _layout(model)
    layer_path = next(n for n, m in model.named_modules() if m is layers)
    layer_devices = [device_map.pop(f"{layer_path}.{i}") for i in range(len(layers))]
    assert not any(k.startswith(layer_path + ".") for k in device_map), "a decoder layer is split"
    order = [devices.index(d) for d in layer_devices]
    assert order == sorted(order) and sorted(set(order)) == list(range(len(devices)))  # contiguous, each non-empty
    assert device_map[_path_of(model, model.get_input_embeddings())] == devices[0]
    per_device = dict.fromkeys(devices, 0)
    for device, layer in zip(layer_devices, layers):
        per_device[device] += module_bytes(layer)
    for path, device in device_map.items():
        per_device[device] += module_bytes(model.get_submodule(path))
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if tied:  # the shared weight sits once, with the embedding
        assert device_map[_path_of(model, model.get_output_embeddings())] == devices[0]
        per_device[devices[0]] -= module_bytes(model.get_output_embeddings())
    else:
        assert device_map[_path_of(model, model.get_output_embeddings())] == devices[-1]
    share = sum(per_device.values()) / len(devices)
    largest = max(module_bytes(layer) for layer in layers)
    assert all(abs(b - share) <= largest for b in per_device.values()), (per_device, share, largest)


def _path_of(model: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


@pytest.mark.parametrize("model_type", sorted(TARGET_ADAPTERS))
@pytest.mark.parametrize("count", [2, 3])
def test_device_map_of_every_family_is_complete_contiguous_and_balanced(model_type, count):
    model = empty_model(small_config(model_type), torch.bfloat16)
    device_map = device_map_for(model, GPUS[:count])
    check_map(model, device_map, GPUS[:count])


def test_tied_head_stays_with_the_embedding():
    from transformers import AutoConfig

    model = empty_model(AutoConfig.for_model("llama", **SMALL, tie_word_embeddings=True), torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    device_map = device_map_for(model, GPUS)
    assert device_map["lm_head"] == "cuda:0" and device_map["model.norm"] == "cuda:2"
    check_map(model, device_map, GPUS)


def test_qwen36_27b_shape_splits_evenly_and_needs_two_48gb_cards():
    from transformers import Qwen3_5TextConfig

    model = empty_model(Qwen3_5TextConfig(**QWEN36_27B), torch.bfloat16)
    device_map = device_map_for(model, GPUS[:2])
    check_map(model, dict(device_map), GPUS[:2])
    assert device_map["model.embed_tokens"] == "cuda:0" and device_map["lm_head"] == "cuda:1"
    assert device_map["model.layers.31"] == "cuda:0" and device_map["model.layers.32"] == "cuda:1"
    size = module_bytes(model)
    assert 53e9 < size < 55e9  # 26.9B parameters in bf16
    assert gpus_per_worker(size, 48 * 10**9) == 2
    assert gpus_per_worker(size, 80 * 10**9) == 1 and gpus_per_worker(size, 141 * 10**9) == 1


def test_split_layers_balances_bytes_and_keeps_every_run_non_empty():
    assert split_layers([10] * 8, 2) == [range(0, 4), range(4, 8)]
    # A big embedding on the first device pushes the first cut down; the head on the last pulls it up.
    assert split_layers([10] * 8, 2, first_bytes=40) == [range(0, 2), range(2, 8)]
    assert split_layers([10] * 8, 2, last_bytes=40) == [range(0, 6), range(6, 8)]
    # Even an embedding larger than a share leaves every device at least one layer.
    assert split_layers([1] * 4, 4, first_bytes=100) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    with pytest.raises(ValueError, match="3 devices for a target with 2 decoder layers"):
        split_layers([1, 1], 3)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_5"])
def test_tiny_target_across_two_devices_captures_what_one_device_does(family):
    spec = {"family": family, "seed": 0, "tokenizer": "builtin"}
    one = load_target("tiny", tiny=spec)
    two = load_target("tiny", tiny=spec, device=["cpu", "cpu"])
    assert hasattr(two.decoder_layers()[0], "_hf_hook")  # dispatched: accelerate's hooks run every layer
    assert two.device == torch.device("cpu") and two.num_layers == one.num_layers
    torch.testing.assert_close(two.capture(IDS, MASK, [1, 5]), one.capture(IDS, MASK, [1, 5]), rtol=0, atol=0)
    features, final = two.capture_with_final(IDS, MASK, [0, 7])
    ref_features, ref_final = one.capture_with_final(IDS, MASK, [0, 7])
    torch.testing.assert_close(features, ref_features, rtol=0, atol=0)
    torch.testing.assert_close(final, ref_final, rtol=0, atol=0)
    logits, features = two.forward_with_features(IDS, MASK, [3])
    ref_logits, ref_features = one.forward_with_features(IDS, MASK, [3])
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    torch.testing.assert_close(features, ref_features, rtol=0, atol=0)


def test_hf_checkpoint_loads_with_a_device_map(tmp_path):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    text = {k: v for k, v in SMALL.items() if not k.startswith(("num_experts", "moe_", "shared_"))}
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=VISION)).save_pretrained(tmp_path)
    build_builtin_tokenizer().save_pretrained(tmp_path)
    one = load_target("hf", str(tmp_path))
    two = load_target("hf", str(tmp_path), device=["cpu", "cpu"])
    assert two.model_type == "qwen3_5_text"
    torch.testing.assert_close(two.capture(IDS, MASK, [0, 6]), one.capture(IDS, MASK, [0, 6]), rtol=0, atol=0)


def test_bad_device_lists_are_refused_with_the_reason():
    tiny = {"family": "qwen3", "seed": 0, "tokenizer": "builtin"}
    with pytest.raises(ValueError, match="9 devices for a target with 8 decoder layers"):
        load_target("tiny", tiny=tiny, device=["cpu"] * 9)
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        load_target("tiny", tiny=tiny, device=["gpu0", "cpu"])
    with pytest.raises(ValueError, match="mix CPU and CUDA"):
        parse_devices(["cuda:0", "cpu"])
    with pytest.raises(ValueError, match="not available"):
        load_target("tiny", tiny=tiny, device=["cuda:98", "cuda:99"])
    with pytest.raises(ValueError, match="kind 'smollm2' loads on one device"):
        load_target("smollm2", device=["cpu", "cpu"])
    with pytest.raises(ValueError, match="empty"):
        parse_devices([])
    assert parse_devices([0, "cuda", "cuda:3", torch.device("cuda", 1)]) == ["cuda:0", "cuda:0", "cuda:3", "cuda:1"]


def test_gpus_per_worker_setting():
    tiny = {"kind": "tiny", "tiny": {"family": "qwen3", "seed": 0}}
    size = target_bytes(tiny)
    # conf/target/tiny.yaml names the tokenizer too: build_tiny_target was given it twice.
    assert target_bytes({"kind": "tiny", "tiny": {"family": "qwen3", "seed": 0, "tokenizer": "auto"}}) == size
    assert resolve_gpus_per_worker(2, tiny, num_devices=4) == 2
    assert resolve_gpus_per_worker("auto", tiny, num_devices=4, gpu_bytes=10 * size) == 1
    assert resolve_gpus_per_worker("auto", tiny, num_devices=4, gpu_bytes=size) == 2  # 80% of a GPU is usable
    # A float32 target weighs twice its bf16 size: "auto" counts the dtype it will load in.
    assert resolve_gpus_per_worker("auto", dict(tiny, dtype="float32"), num_devices=4, gpu_bytes=2 * size) == 2
    assert resolve_gpus_per_worker("auto", dict(tiny, dtype="auto"), num_devices=4, gpu_bytes=2 * size) == 1
    if not torch.cuda.is_available():
        assert resolve_gpus_per_worker("auto", tiny, num_devices=3) == 1
    with pytest.raises(ValueError, match="does not divide the 3 capture GPU"):
        resolve_gpus_per_worker(2, tiny, num_devices=3)
    with pytest.raises(ValueError, match="expected a positive int or 'auto'"):
        resolve_gpus_per_worker("two", tiny, num_devices=2)
    assert rank_devices(1, 2) == ["cuda:2", "cuda:3"]


@pytest.mark.gpu(devices=2)
@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_5", "qwen3_next"])
def test_two_gpus_capture_what_one_gpu_does_and_return_on_the_first(family):
    spec = {"family": family, "seed": 0, "tokenizer": "builtin"}
    one = load_target("tiny", tiny=spec, device="cuda:0", dtype="float32")
    two = load_target("tiny", tiny=spec, device=["cuda:0", "cuda:1"], dtype="float32")
    layer_devices = [{str(p.device) for p in layer.parameters()} for layer in two.decoder_layers()]
    assert layer_devices == [{"cuda:0"}] * 4 + [{"cuda:1"}] * 4 and two.device == torch.device("cuda:0")
    ids, mask = IDS.to("cuda:0"), MASK.to("cuda:0")
    features = two.capture(ids, mask, [1, 6])
    assert features.device == torch.device("cuda:0")
    torch.testing.assert_close(features, one.capture(ids, mask, [1, 6]))
    features, final = two.capture_with_final(ids, mask, [7])
    ref_features, ref_final = one.capture_with_final(ids, mask, [7])
    assert final.device == torch.device("cuda:0")
    torch.testing.assert_close(final, ref_final)
    logits, features = two.forward_with_features(ids, mask, [5])
    ref_logits, ref_features = one.forward_with_features(ids, mask, [5])
    assert logits.device == features.device == torch.device("cuda:0")
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(features, ref_features)
    print(f"{family}: {two.model.hf_device_map}")
