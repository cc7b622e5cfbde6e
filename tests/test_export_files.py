"""The exported drafter folder: file modes follow the umask, a failed swap keeps the previous export, and z-lab
configs with reference options this drafter lacks are refused."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from dflash.eval import export
from dflash.eval.export import export_zlab, load_drafter, process_umask
from dflash.models.drafter_config import DrafterConfig
from tests.test_export import small_drafter

@pytest.fixture
def umask():
    """set(mask): the process umask for the test, restored after it."""
    saved = os.umask(0o022)
    os.umask(saved)
    yield os.umask
    os.umask(saved)


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_export_modes_follow_the_umask(tmp_path, umask, mask):
    umask(mask)
    assert process_umask() == mask
    out = export_zlab(small_drafter(), str(tmp_path / "export"))
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~mask
    for name in os.listdir(out):
        assert os.stat(os.path.join(out, name)).st_mode & 0o777 == 0o666 & ~mask, name


def test_process_umask_without_proc(umask, monkeypatch):
    def no_proc(*args, **kwargs):
        raise OSError("no /proc")

    umask(0o026)
    monkeypatch.setattr(export, "open", no_proc, raising=False)
    assert process_umask() == 0o026
    assert os.umask(0o026) == 0o026  # and the mask is left as it was


def test_failed_swap_keeps_the_previous_export(tmp_path, monkeypatch):
    out = str(tmp_path / "export")
    first = small_drafter()
    export_zlab(first, out, dtype=torch.float32)
    replace, calls = os.replace, []

    def second_fails(source, destination):
        calls.append(destination)
        if destination == out and calls.count(out) == 1:  # the new export moving in, after the old one moved out
            raise OSError("disk gone")
        replace(source, destination)

    monkeypatch.setattr(os, "replace", second_fails)
    with pytest.raises(OSError, match="disk gone"):
        export_zlab(small_drafter(("full_attention",)), out, dtype=torch.float32)
    monkeypatch.undo()
    assert calls[-3].endswith(".old") and calls[-2:] == [out, out]  # failed moving in; the old one moved back
    assert sorted(os.listdir(tmp_path)) == ["export"]
    assert load_drafter(out).config == first.config


def zlab_config() -> dict:
    return small_drafter().config.to_zlab()


@pytest.mark.parametrize("where", ["dflash_config", "top"])
@pytest.mark.parametrize("name, value", [("input_embedding_scale", 2.0)])
def test_zlab_config_with_a_reference_option_on_is_refused(where, name, value, tmp_path):
    config = zlab_config()
    (config["dflash_config"] if where == "dflash_config" else config)[name] = value
    with pytest.raises(ValueError, match=f"{name}={value}"):
        DrafterConfig.from_zlab(config)
    # Through load_drafter too: a published folder with such a config is not loaded.
    out = export_zlab(small_drafter(), str(tmp_path / "export"))
    os.remove(os.path.join(out, "checksums.json"))  # a published folder has none
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=name):
        load_drafter(out)


def test_zlab_is_causal_is_refused_only_where_it_changes_a_layer():
    config = zlab_config()
    kinds = config["layer_types"]
    assert kinds == ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="is_causal=True"):
        DrafterConfig.from_zlab({**config, "is_causal": True})  # the full layer would become causal
    with pytest.raises(ValueError, match="is_causal=False"):  # the sliding layer would become bidirectional
        DrafterConfig.from_zlab({**config, "dflash_config": {**config["dflash_config"], "is_causal": False}})
    all_full = {**config, "layer_types": ["full_attention"] * len(kinds), "is_causal": False}
    assert DrafterConfig.from_zlab(all_full).layer_types == ["full_attention"] * len(kinds)
    assert DrafterConfig.from_zlab({**config, "is_causal": None}) == small_drafter().config


def test_zlab_config_with_reference_options_off_loads():
    config = zlab_config()
    config["dflash_config"].update(input_embedding_scale=1.0, output_multiplier=1, final_logit_softcapping=None)
    config.update(final_logit_softcapping=0.0, output_multiplier=1.0)
    assert DrafterConfig.from_zlab(config) == small_drafter().config


@pytest.mark.parametrize("change, named", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope_parameters.yarn"),
    ({"rope_scaling": {"type": "linear", "factor": 4.0}}, "rope_scaling.linear"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"use_swa": True, "swa_window_size": 64}, "use_swa=True"),
    ({"architectures": ["Qwen3ForCausalLM"]}, r"architectures \['Qwen3ForCausalLM'\]"),
    ({"causal": True}, "causal=True, which makes layers \\[1\\] causal"),
])
def test_zlab_options_that_change_the_drafter_are_refused(change, named):
    """Fields the reference or vLLM read that this drafter does not implement: loaded, it would draft otherwise."""
    with pytest.raises(ValueError, match=named):
        DrafterConfig.from_zlab({**zlab_config(), **change})
    plain = {**zlab_config(), "rope_scaling": None, "hidden_act": "silu", "use_swa": False,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert DrafterConfig.from_zlab(plain) == small_drafter().config


def test_taps_out_of_layer_order_are_refused():
    """Serving engines join the taps' features in layer order; a drafter trained on another order would be served its
    fc input permuted."""
    config = zlab_config()
    with pytest.raises(ValueError, match=r"target_layer_ids \[5, 1, 3\] are not distinct and ascending"):
        DrafterConfig.from_zlab({**config, "dflash_config": {**config["dflash_config"], "target_layer_ids": [5, 1, 3]}})
    with pytest.raises(ValueError, match="not distinct and ascending"):
        replace(small_drafter().config, target_layer_ids=[1, 1, 3])
