"""Any decoder-only causal LM of transformers with the standard layout, taken without a registry line.

The standard layout: `model.get_decoder()` (or `model.model` where that returns the LM itself) is the decoder
stack; it holds one nn.ModuleList of `config.num_hidden_layers` decoder layers and a final norm whose output is
the lm_head's input;
`get_input_embeddings()` and `get_output_embeddings()` are the embedding and the head. Families whose layers keep
a recurrent state (Mamba mixers, GDN, short convolutions) are not taken: speculative decoding rolls a target back
after a rejected draft, which needs an adapter that snapshots that state (HybridTargetAdapter does it for GDN).
`unsupported_reason` says why a model cannot be taken; it works on a meta-device model, so a target is refused
before its weights are read.
"""

from __future__ import annotations

import re

from typing import Any

import torch
from torch import nn

from dflash.models.targets.base import TargetAdapter

# Layer kinds of `config.layer_types` that are attention: a KV cache crop rolls them back.
ATTENTION_LAYER_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "attention")
# Parts of module class names that hold a recurrent or convolution state across tokens; "SSM" only as a word of the
# CamelCase name (GptOssMLP holds the letters too).
STATEFUL_NAME_PARTS = ("mamba", "deltanet", "rwkv", "recurrent", "shortconv", "linearattention")
STATEFUL_WORDS = ("ssm", "ssd")
# Config fields that hybrid families use to say which layers are not attention.
HYBRID_PATTERN_FIELDS = ("layers_block_type", "hybrid_override_pattern", "layers_block_types", "block_types")
FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "norm_f", "ln_f")


def decoder_stack(model: nn.Module) -> nn.Module | None:
    """The decoder stack: `model.get_decoder()`, else `model.model` or `model.base_model` when that one holds the
    layer list; None when neither is there."""
    get_decoder = getattr(model, "get_decoder", None)
    try:
        decoder = get_decoder() if get_decoder is not None else None
    except (AttributeError, NotImplementedError):
        decoder = None
    if decoder is not None and decoder is not model:
        return decoder
    # Some text LMs' get_decoder() returns the LM itself (Llama4ForCausalLM in transformers 5.25), though their
    # decoder stack sits at `.model` as in any other *ForCausalLM.
    num_layers = int(getattr(model.config.get_text_config(), "num_hidden_layers", 0) or 0)
    for name in ("model", "base_model"):
        candidate = getattr(model, name, None)
        if isinstance(candidate, nn.Module) and candidate is not model and \
                layer_list(candidate, num_layers) is not None:
            return candidate
    return None


def layer_list(decoder: nn.Module, num_layers: int) -> nn.ModuleList | None:
    """The decoder's ModuleList of `num_layers` layers: `decoder.layers`, else its one child list of that length."""
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
        return layers
    lists = [m for m in decoder.children() if isinstance(m, nn.ModuleList) and len(m) == num_layers]
    return lists[0] if len(lists) == 1 else None


def final_norm_of(decoder: nn.Module) -> nn.Module | None:
    for name in FINAL_NORM_NAMES:
        module = getattr(decoder, name, None)
        if isinstance(module, nn.Module):
            return module
    return None


def stateful_part(model: nn.Module, layers: nn.ModuleList) -> str | None:
    """Where a layer of `model` keeps state across tokens (e.g. "layer 0 holds JambaMambaMixer"), or None."""
    config = model.config.get_text_config()
    kinds = [k for k in (getattr(config, "layer_types", None) or []) if k not in ATTENTION_LAYER_KINDS]
    if kinds:
        return f"config.layer_types has {sorted(set(map(str, kinds)))} layers"
    for field in HYBRID_PATTERN_FIELDS:
        if getattr(config, field, None):
            return f"config.{field} mixes non-attention layers into the stack"
    for index, layer in enumerate(layers):
        for module in layer.modules():
            name = type(module).__name__
            words = {w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z][a-z0-9]*", name)}
            if isinstance(module, nn.Conv1d) or any(part in name.lower() for part in STATEFUL_NAME_PARTS) or \
                    words & set(STATEFUL_WORDS):
                return f"decoder layer {index} holds {name}"
    return None


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the generic adapter cannot take `model` (one sentence naming what is missing), or None when it can."""
    config = model.config
    family = f"{config.model_type!r} ({type(model).__name__})"
    if getattr(config, "is_encoder_decoder", False):
        return f"{family} is an encoder-decoder model; a target must be a decoder-only causal LM"
    decoder = decoder_stack(model)
    if decoder is None:
        return f"{family} has no decoder stack (get_decoder(), .model or .base_model) holding its layer list"
    num_layers = int(getattr(config.get_text_config(), "num_hidden_layers", 0) or 0)
    layers = layer_list(decoder, num_layers)
    if layers is None:
        return (f"{family}: {type(decoder).__name__} has no list of {num_layers} decoder layers "
                "(config.num_hidden_layers)")
    head = model.get_output_embeddings()
    if head is None or model.get_input_embeddings() is None:
        return f"{family} has no input or output embeddings (get_input_embeddings / get_output_embeddings)"
    altup = getattr(config.get_text_config(), "altup_num_inputs", None)
    if altup:
        return (f"{family} runs AltUp: its decoder layers output {altup} stacked streams [altup, batch, tokens, "
                "hidden] (config.altup_num_inputs), not the [batch, tokens, hidden] state a tap captures")
    if getattr(head, "bias", None) is not None:
        return f"{family} has an lm_head bias, which the drafter's shared head (a weight only) does not carry"
    state = stateful_part(model, layers)
    if state is not None:
        return (f"{family} keeps recurrent state in its layers ({state}), which speculative decoding must restore "
                "after a rejected draft, and no adapter snapshots it: register one in "
                "dflash/models/targets/registry.py (as HybridTargetAdapter does for GDN)")
    if final_norm_of(decoder) is None:
        return f"{family}: {type(decoder).__name__} has no final norm (one of {', '.join(FINAL_NORM_NAMES)})"
    return None


class UnsupportedTarget(ValueError):
    """A model no adapter can take; the message names its family and what is missing."""


class GenericTargetAdapter(TargetAdapter):
    """A decoder-only *ForCausalLM found through `get_decoder()` (module docstring).

    At construction one short forward checks that the model's logits are `logit_transform(final @ lm_head^T)` and
    that its decoder layers output [batch, tokens, hidden]: a family that does something else to its logits or its
    layer outputs is refused rather than trained against the wrong distribution or features.
    """

    def __init__(self, model: nn.Module, tokenizer: Any) -> None:
        super().__init__(model, tokenizer)
        self.check_logits()

    def text_model(self) -> nn.Module:
        return decoder_stack(self.model)

    def decoder_layers(self) -> nn.ModuleList:
        return layer_list(self.text_model(), int(self.model.config.get_text_config().num_hidden_layers))

    def final_norm(self) -> nn.Module:
        return final_norm_of(self.text_model())

    def check_logits(self, length: int = 8) -> None:
        """UnsupportedTarget unless the model's logits of a few tokens equal the head applied to the final state and
        its first decoder layer's output has the final state's shape."""
        ids = torch.arange(length, device=self.device)[None] % self.vocab_size
        with torch.no_grad():
            # The decoder stack's own output, not output_hidden_states: asking for that once leaves transformers'
            # output-recording hooks on the layers, which torch.compile of the static engine's step cannot trace.
            with self.taps([0]) as taps:
                final = self.text_model()(input_ids=ids, use_cache=False).last_hidden_state
            head = self.lm_head_weight()
            ours = self.logit_transform(final.to(device=head.device, dtype=torch.float32) @ head.float().T)
            theirs = self.model(input_ids=ids, use_cache=False).logits
        if tuple(taps[0].shape) != tuple(final.shape):
            raise UnsupportedTarget(
                f"target {self.model_type!r} ({type(self.model).__name__}): its decoder layers output a tensor of "
                f"shape {tuple(taps[0].shape)}, not the [batch, tokens, hidden] {tuple(final.shape)} of its final "
                "state, which a tap captures")
        theirs = theirs.to(device=ours.device, dtype=torch.float32)
        error = float((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-6))
        if not error <= (1e-4 if self.dtype == torch.float32 else 2e-2):
            raise UnsupportedTarget(
                f"target {self.model_type!r} ({type(self.model).__name__}) makes its logits in a way the drafter's "
                f"shared head cannot repeat: {self.logit_transform} of its final hidden state is off by {error:.2g} "
                f"(relative); its final logit transform needs an entry in dflash/models/targets/logit_transform.py")
