"""The DFlash drafter: Qwen3-style layers whose keys/values are prefixed by the projected target context.

Read top to bottom: norm, rotary, MLP, attention, layer, model. Parameter names follow the reference
`DFlashDraftModel` (method.md §1) so a checkpoint loads into either without renaming. The module has no
embedding and no lm_head: the caller embeds the block with the target's frozen embedding and applies the target's
frozen head to the output. Nothing here knows about distribution or about how masks are built for training.

Attention masks: `attention_mask` maps a layer type ("full_attention" / "sliding_attention") to a boolean tensor
broadcastable to [batch, heads, queries, keys], True where the key is visible, or to a FlexAttention BlockMask.
When it is None (inference on one block) full layers see everything and sliding layers are causal with a window,
by position id.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash.models.drafter_config import DrafterConfig


class DFlashRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            # One kernel on CUDA (aten::_fused_rms_norm) where the form below launches eight: the live drafting step
            # is bound by its kernel count. It normalises in float32 and rounds once, after the weight.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DFlashRotaryEmbedding(nn.Module):
    """Plain 1-D RoPE with the drafter's own theta, whatever RoPE the target uses (method.md §1).

    The frequencies are recomputed in fp32 on every call rather than kept as a buffer: `module.to(bfloat16)`
    would round a buffer and shift the angles by radians at positions in the thousands.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        exponents = torch.arange(0, self.head_dim, 2, device=position_ids.device, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponents)
        freqs = position_ids[..., None].float() * inv_freq
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, length, head_dim]; cos/sin: [batch, length, head_dim]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up that keeps gate and up for backward and recomputes silu(gate) there.

    Autograd would also keep silu(gate): a third [tokens, intermediate] tensor per layer (1.3 GiB over the
    Qwen3.6-27B drafter's 5 layers at 8192 query positions), for one cheap elementwise kernel. The gradients are
    the ones autograd makes (the same kernels on the same values): d up = g * silu(gate), d gate =
    silu_backward(g * up, gate).
    """

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


class DFlashMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return self.down_proj(_SiluMul.apply(gate, up))
        return self.down_proj(F.silu(gate) * up)


def sliding_mask_from_positions(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int
) -> torch.Tensor:
    """Causal + window visibility by position id: key visible iff key <= query and query - key < window."""
    distance = query_positions[:, :, None] - key_positions[:, None, :]
    return ((distance >= 0) & (distance < window))[:, None]


_compiled_flex = None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, enable_gqa: bool) -> torch.Tensor:
    """Scaled dot-product attention: SDPA for a boolean mask (or None), FlexAttention for a BlockMask.

    The training forward passes BlockMasks on CUDA (the block-sparse mask without a dense grid); flex runs
    compiled there, eager elsewhere (unfused, only for tests). Both give the softmax(q k^T / sqrt(d)) v of SDPA.
    """
    if mask is None or isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():
        # Inside a compiled layer (train.compile) the layer's graph captures flex itself. Reading the lazily built
        # global below there put a guard on it (None at the first trace, set later): a recompile at step 2.
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
    global _compiled_flex
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention)
        return _compiled_flex(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
    return flex_attention(q, k, v, block_mask=mask, enable_gqa=enable_gqa)


class DFlashAttention(nn.Module):
    """Queries from block tokens only; keys/values = [context feature ++ block], each through this layer's k/v."""

    def __init__(self, config: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, q_out, kv_out = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_out, bias=False)
        self.k_proj = nn.Linear(hidden, kv_out, bias=False)
        self.v_proj = nn.Linear(hidden, kv_out, bias=False)
        self.o_proj = nn.Linear(q_out, hidden, bias=False)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor,
                    rotary: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys (k_norm, then RoPE) and values [batch, kv_heads, n, head_dim] of inputs x [batch, n,
        hidden] at the positions of rotary (cos, sin [batch, n, head_dim])."""
        batch, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(batch, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, *rotary), v

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        rotary: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """context: the projected target context [batch, C, hidden], with rotary over the C context positions and
        then the block's; or this layer's keys/values of it computed before (`keys_values`), with rotary over the
        block's positions only."""
        batch, num_queries, _ = hidden_states.shape
        cos, sin = rotary
        if isinstance(context, torch.Tensor):
            num_context = context.shape[1]
            k, v = self.keys_values(torch.cat([context, hidden_states], dim=1), rotary)
        else:
            num_context = 0
            block_keys, block_values = self.keys_values(hidden_states, rotary)
            k, v = torch.cat([context[0], block_keys], dim=2), torch.cat([context[1], block_values], dim=2)
        q = self.q_norm(self.q_proj(hidden_states).view(batch, num_queries, self.num_heads, self.head_dim))
        q = apply_rotary(q.transpose(1, 2), cos[:, num_context:], sin[:, num_context:])
        out = attend(q, k, v, mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, num_queries, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        rotary: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        # The context feature is not normed here: it enters keys/values only (method.md §1).
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), context, rotary, mask)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashDraftModel(nn.Module):
    """Trainable tensors: layers.*, fc, hidden_norm, norm -- exactly those of a z-lab checkpoint."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(config.num_taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = DFlashRotaryEmbedding(config.head_dim, config.rope_theta)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Normal(0, std) linears and unit norms, from a private generator so init never depends on global RNG."""
        generator = torch.Generator().manual_seed(seed)
        for name, param in sorted(self.named_parameters()):
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * std)

    def context_keys_values(self, target_hidden: torch.Tensor,
                            position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys/values [batch, kv_heads, C, head_dim] of target features [batch, C, taps * hidden]
        at positions [batch, C]: what `forward` computes from `target_hidden` on every call, kept by decoders whose
        verified context only grows (`context_keys_values=` of forward)."""
        self._check_features(target_hidden)
        context = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        rotary = self.rotary_emb(position_ids, context.dtype)
        return [layer.self_attn.keys_values(context, rotary) for layer in self.layers]

    def forward(
        self,
        position_ids: torch.Tensor,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor | None = None,
        attention_mask: dict[str, torch.Tensor] | None = None,
        context_keys_values: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Block hidden states after the final norm.

        noise_embedding: [batch, queries, hidden] = target embedding of [anchor, MASK, ...] per block. The context
        comes as one of
        - target_hidden: [batch, context, taps * hidden] = concatenated target features, with position_ids
          [batch, context + queries] (context positions, then block positions);
        - context_keys_values: every layer's keys/values of the context (`context_keys_values`), with position_ids
          [batch, queries] (the block's; the context's are in its keys). attention_mask is then needed for sliding
          layers, since the keys' positions are not known here.
        """
        if (target_hidden is None) == (context_keys_values is None):
            raise ValueError("give the context as exactly one of target_hidden and context_keys_values")
        hidden_states = noise_embedding.to(self.fc.weight.dtype)
        rotary = self.rotary_emb(position_ids, hidden_states.dtype)
        if context_keys_values is not None:
            if len(context_keys_values) != len(self.layers):
                raise ValueError(f"context_keys_values has {len(context_keys_values)} layers, the drafter "
                                 f"{len(self.layers)}")
            if attention_mask is None and self.config.sliding_window is not None:
                raise ValueError("a cached context needs attention_mask for the sliding layers")
            contexts = context_keys_values
        else:
            self._check_features(target_hidden)
            context = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
            contexts = [context] * len(self.layers)
        masks = attention_mask if attention_mask is not None else self._inference_masks(position_ids, hidden_states)
        for layer, layer_context in zip(self.layers, contexts):
            hidden_states = layer(hidden_states, layer_context, rotary, masks.get(layer.self_attn.layer_type))
        return self.norm(hidden_states)

    def _check_features(self, target_hidden: torch.Tensor) -> None:
        expected = self.config.num_taps * self.config.hidden_size
        if target_hidden.shape[-1] != expected:
            raise ValueError(
                f"target_hidden has feature size {target_hidden.shape[-1]}, expected {expected} "
                f"({self.config.num_taps} taps x hidden {self.config.hidden_size})"
            )

    def _inference_masks(self, position_ids: torch.Tensor, hidden_states: torch.Tensor) -> dict[str, torch.Tensor]:
        masks: dict[str, torch.Tensor] = {}
        if self.config.sliding_window is not None:
            query_positions = position_ids[:, -hidden_states.shape[1]:]
            masks["sliding_attention"] = sliding_mask_from_positions(
                query_positions, position_ids, self.config.sliding_window
            )
        return masks
