"""z-lab export: round trip, config.json contents, only drafter tensors, clear errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash.config.errors import CorruptFile
from dflash.eval.export import export_zlab, load_drafter
from dflash.models.drafter import DFlashDraftModel
from dflash.models.drafter_config import DrafterConfig
from dflash.models.targets.logit_transform import LogitTransform


def small_config(layer_types=("sliding_attention", "full_attention"), sliding_window=6) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=len(layer_types), num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=100, num_target_layers=8, target_layer_ids=[1, 3, 5],
        mask_token_id=99, block_size=4, layer_types=list(layer_types), sliding_window=sliding_window,
        rope_theta=10000.0,
    )


def small_drafter(layer_types=("sliding_attention", "full_attention")) -> DFlashDraftModel:
    drafter = DFlashDraftModel(small_config(layer_types))
    drafter.init_weights(seed=1, std=0.1)
    return drafter.eval()


def run(drafter, context=10, queries=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = drafter.config.hidden_size
    target_hidden = torch.randn(2, context, 3 * hidden, generator=generator)
    noise = torch.randn(2, queries, hidden, generator=generator)
    positions = torch.arange(context + queries).expand(2, -1)
    with torch.no_grad():
        return drafter(positions, noise, target_hidden)


def test_round_trip_float32_is_identical(tmp_path):
    drafter = small_drafter()
    out = export_zlab(drafter, str(tmp_path / "export"), dtype=torch.float32)
    loaded = load_drafter(out)
    assert loaded.config == drafter.config
    assert torch.equal(run(loaded), run(drafter))
    # Exporting again over an existing folder replaces it and leaves no temporary folders behind.
    export_zlab(drafter, out, dtype=torch.float32)
    assert sorted(os.listdir(tmp_path)) == ["export"]
    assert sorted(os.listdir(out)) == ["checksums.json", "config.json", "model.safetensors"]


def test_bfloat16_export_rounds_weights_only(tmp_path):
    drafter = small_drafter()
    out = export_zlab(drafter, str(tmp_path / "export"))
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    loaded = load_drafter(out, dtype=torch.bfloat16)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16)), name
    # RoPE angles stay exact even when the weights are bf16 (serving engines compute them in fp32).
    positions = torch.tensor([[4000]])
    torch.testing.assert_close(loaded.rotary_emb(positions, torch.float32)[0],
                               drafter.rotary_emb(positions, torch.float32)[0])
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"


def test_config_json_is_zlab(tmp_path):
    drafter = small_drafter()
    out = export_zlab(drafter, str(tmp_path / "export"))
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}  # as the published drafters have it
    assert config["dflash_config"] == {"mask_token_id": 99, "target_layer_ids": [1, 3, 5], "block_size": 4}
    assert config["block_size"] == 4 and config["num_target_layers"] == 8
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["sliding_window"] == 6 and config["use_sliding_window"] is True
    assert config["vocab_size"] == 100 and config["tie_word_embeddings"] is False
    assert DrafterConfig.from_zlab(config) == drafter.config


@pytest.mark.parametrize("transform, written", [
    (LogitTransform(scale=0.25), {"output_multiplier": 0.25}),  # Granite's logits_scaling of 4
    (LogitTransform(softcap=30.0), {"final_logit_softcapping": 30.0}),  # Gemma's soft cap
    (LogitTransform(scale=0.5, softcap=20.0), {"output_multiplier": 0.5, "final_logit_softcapping": 20.0}),
])
def test_the_targets_logit_transform_is_exported_and_loaded_back(transform, written, tmp_path):
    """The drafter's logits go through the target's transform in training and eval; the reference applies the
    config's output_multiplier, then final_logit_softcapping, so the export writes them (only when not the identity)."""
    plain = small_drafter()
    drafter = DFlashDraftModel(plain.config.with_logit_transform(transform))
    drafter.load_state_dict(plain.state_dict())
    out = export_zlab(drafter, str(tmp_path / "export"))
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["dflash_config"] == {"mask_token_id": 99, "target_layer_ids": [1, 3, 5], "block_size": 4, **written}
    loaded = load_drafter(out)
    assert loaded.config == drafter.config and loaded.config.logit_transform == transform
    assert DrafterConfig.from_zlab(loaded.config.to_zlab()) == drafter.config
    # The reference reads them at the top level too when dflash_config has none.
    top = {**config, **written, "dflash_config": {k: v for k, v in config["dflash_config"].items() if k not in written}}
    assert DrafterConfig.from_zlab(top) == drafter.config
    # The identity writes nothing new: the exports for other targets stay byte-identical.
    identity = DFlashDraftModel(drafter.config.with_logit_transform(LogitTransform()))
    identity.load_state_dict(plain.state_dict())
    export_zlab(identity, str(tmp_path / "identity"))
    export_zlab(plain, str(tmp_path / "plain"))
    assert (tmp_path / "identity" / "config.json").read_bytes() == (tmp_path / "plain" / "config.json").read_bytes()


def test_a_zlab_window_is_dropped_without_use_sliding_window_as_hugging_face_does():
    config = small_drafter().config.to_zlab()
    assert DrafterConfig.from_zlab(config).sliding_window == 6
    for off in ({"use_sliding_window": False}, {}):
        changed = {k: v for k, v in config.items() if k != "use_sliding_window"} | off
        with pytest.raises(ValueError, match=r"sliding_attention layers \[0\] but use_sliding_window=.*drops "
                                             r"sliding_window=6"):
            DrafterConfig.from_zlab(changed)
    # Full layers only: the window is dropped, as it is unused.
    full = small_drafter(("full_attention",)).config.to_zlab()
    assert DrafterConfig.from_zlab({**full, "use_sliding_window": False, "sliding_window": 6}).sliding_window is None


def test_safetensors_holds_only_drafter_tensors(tmp_path):
    drafter = small_drafter()
    out = export_zlab(drafter, str(tmp_path / "export"))
    names = set(load_file(os.path.join(out, "model.safetensors")))
    assert names == {name for name, _ in drafter.named_parameters()}
    assert all(n.startswith(("layers.", "fc.", "hidden_norm.", "norm.")) for n in names)
    assert not any("rotary" in n or "embed" in n or "lm_head" in n for n in names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="drafter folder not found"):
        load_drafter(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_drafter(str(tmp_path / "empty"))
    out = export_zlab(small_drafter(), str(tmp_path / "export"))
    os.remove(os.path.join(out, "checksums.json"))  # as a folder written by another tool
    weights = os.path.join(out, "model.safetensors")
    tensors = load_file(weights)
    fc = tensors.pop("fc.weight")
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=r"missing \['fc.weight'\]"):
        load_drafter(out)
    save_file({**tensors, "fc.weight": fc, "embed_tokens.weight": torch.zeros(100, 32)}, weights)
    with pytest.raises(ValueError, match=r"unexpected \['embed_tokens.weight'\]"):
        load_drafter(out)
    save_file({**tensors, "fc.weight": fc[:, :10].contiguous()}, weights)
    with pytest.raises(ValueError, match="fc.weight"):
        load_drafter(out)
    os.remove(weights)
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_drafter(out)


def test_a_non_finite_drafter_is_never_exported_nor_loaded(tmp_path):
    from dflash.eval.export import NonFiniteWeights

    drafter = small_drafter()
    out = export_zlab(drafter, str(tmp_path / "export"), dtype=torch.float32)
    before = open(os.path.join(out, "model.safetensors"), "rb").read()
    with torch.no_grad():
        drafter.fc.weight[0, :3] = float("nan")
        drafter.norm.weight[1] = float("inf")
    with pytest.raises(NonFiniteWeights, match=r"2 tensor\(s\).*fc.weight \(3 of .*norm.weight \(1 of"):
        export_zlab(drafter, out, dtype=torch.float32)
    assert open(os.path.join(out, "model.safetensors"), "rb").read() == before  # the good export stays
    tensors = load_file(os.path.join(out, "model.safetensors"))
    tensors["fc.weight"][0, 0] = float("nan")  # corrupted on disk, or written by another tool
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with pytest.raises(CorruptFile, match=f"drafter folder {out} is corrupt: model.safetensors differs"):
        load_drafter(out)
    os.remove(os.path.join(out, "checksums.json"))  # written by another tool: no checksums
    with pytest.raises(NonFiniteWeights, match=f"drafter weights in {out}: 1 tensor"):
        load_drafter(out)


def test_a_window_is_checked_against_the_block_only_where_a_layer_slides():
    """sliding_window below block_size is refused for a sliding layer (it would not see its own anchor) and ignored
    without one, as drafter.sliding_window is where no layer slides (the schema's `unused`)."""
    with pytest.raises(ValueError, match="sliding_window 2 is smaller than block_size 4"):
        small_config(["sliding_attention", "full_attention"], sliding_window=2)
    assert small_config(["full_attention", "full_attention"], sliding_window=2).to_zlab()["sliding_window"] is None


def test_what_a_killed_export_left_is_settled_by_the_next(tmp_path):
    """A kill inside export_zlab leaves its temporary folder (writing) or, between its two renames, no export at all:
    the previous export, set aside, comes back before anything else, and the leftovers go (under today's names and
    the random ones exports had before)."""
    first, second = small_drafter(), DFlashDraftModel(small_config())
    second.init_weights(seed=2, std=0.1)
    out = tmp_path / "export"
    (tmp_path / ".export.k2j4x9ab.tmp").mkdir()  # an export of an earlier version, killed long ago
    (tmp_path / ".export.k2j4x9ab.tmp.old").mkdir()
    (tmp_path / ".export.v2.k2j4x9ab.tmp").mkdir()  # the folder export.v2's: not this export's to touch
    export_zlab(first, str(out))
    written = (out / "model.safetensors").read_bytes()
    os.replace(out, tmp_path / ".export.tmp-123.old")  # killed after setting the old export aside
    (tmp_path / ".export.tmp-123").mkdir()  # and before the new one took its place
    (tmp_path / ".export.tmp-123" / "model.safetensors").write_bytes(b"half")
    (tmp_path / ".exports.tmp-9").mkdir()  # another folder's: not this export's to touch
    broken = small_drafter()
    with torch.no_grad():
        broken.fc.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="hold NaN"):  # fails before it writes: the old one is back all the same
        export_zlab(broken, str(out))
    assert (out / "model.safetensors").read_bytes() == written
    assert sorted(os.listdir(tmp_path)) == [".export.v2.k2j4x9ab.tmp", ".exports.tmp-9", "export"]
    export_zlab(second, str(out))
    assert sorted(os.listdir(tmp_path)) == [".export.v2.k2j4x9ab.tmp", ".exports.tmp-9", "export"]
    assert load_drafter(str(out)).state_dict()["fc.weight"].equal(second.state_dict()["fc.weight"].bfloat16())
