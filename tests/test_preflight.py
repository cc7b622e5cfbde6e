"""The target preflight (dflash/models/targets/preflight.py): a checkpoint's config read and matched to an adapter
without its weights, and a checkpoint that cannot be a target refused in one line."""

from __future__ import annotations

import json

import transformers

from dflash.models.targets.preflight import target_problem
from tests.test_targets_generic import gemma3n_text_config

_QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "vocab_size": 320}


def test_a_config_transformers_rejects_is_one_line(tmp_path):
    """A pruned checkpoint whose layer_types still lists the layers it lost fails transformers' config validation
    (huggingface_hub's StrictDataclassClassValidationError, not a ValueError)."""
    (tmp_path / "config.json").write_text(json.dumps({**_QWEN3, "layer_types": ["full_attention"] * 6}))
    problem = target_problem(str(tmp_path))
    assert problem == "its config cannot be read: `num_hidden_layers` (4) must be equal to the number of " \
                      "`layer_types` (6)"
    (tmp_path / "config.json").write_text(json.dumps(_QWEN3))
    assert target_problem(str(tmp_path)) is None


def test_a_family_whose_layers_output_stacked_streams_is_refused(tmp_path):
    gemma3n_text_config().save_pretrained(tmp_path)
    problem = target_problem(str(tmp_path))
    assert problem.startswith("target 'gemma3n_text' (Gemma3nForCausalLM) runs AltUp") and "\n" not in problem


def test_llama4_text_passes(tmp_path):
    transformers.Llama4TextConfig(**{k: v for k, v in _QWEN3.items() if k not in ("model_type", "architectures")},
                                  intermediate_size_mlp=128, num_local_experts=2).save_pretrained(tmp_path)
    assert target_problem(str(tmp_path)) is None
