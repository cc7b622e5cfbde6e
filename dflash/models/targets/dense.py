"""Dense decoder-only targets (llama, mistral, qwen2, qwen3 and their MoE variants): layers at model.model.layers."""

from __future__ import annotations

from torch import nn

from dflash.models.targets.base import TargetAdapter


class DenseTargetAdapter(TargetAdapter):
    """A *ForCausalLM whose decoder stack is `model.model` (embed_tokens, layers, norm)."""

    def text_model(self) -> nn.Module:
        return self.model.model
