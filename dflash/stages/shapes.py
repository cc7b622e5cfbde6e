"""The target's shape as the capture stage records it (features/target.json), and the drafter's config built from
the drafter settings with null sizes taken from that shape."""

from __future__ import annotations

from typing import Any


def target_shape(adapter) -> dict[str, Any]:
    config = adapter.config
    heads = int(config.num_attention_heads)
    return {
        "model_type": adapter.model_type,
        "num_layers": adapter.num_layers,
        "hidden_size": adapter.hidden_size,
        "vocab_size": adapter.vocab_size,
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(config, "head_dim", None) or adapter.hidden_size // heads),
        "intermediate_size": int(config.intermediate_size),
    }


def drafter_config(settings: Any, shape: dict[str, Any]):
    """The DrafterConfig of a run (`settings`: RunSettings or the composed config): the drafter group, with null
    fields taken from the target. ValueError names a size, tap or mask token the target does not have."""
    from dflash.models.drafter_config import DrafterConfig, default_target_layer_ids

    d = settings.drafter
    if d.hidden_size is not None and int(d.hidden_size) != shape["hidden_size"]:
        raise ValueError(
            f"drafter.hidden_size {d.hidden_size} differs from the target's hidden size {shape['hidden_size']}: "
            f"the drafter shares the target's embedding and lm_head, so they must be equal"
        )
    layer_ids = list(d.target_layer_ids) if d.target_layer_ids is not None else \
        default_target_layer_ids(shape["num_layers"], int(d.num_taps))
    mask = settings.target.mask_token_id
    pick = lambda key: int(getattr(d, key)) if getattr(d, key) is not None else shape[key]  # noqa: E731
    return DrafterConfig(
        hidden_size=shape["hidden_size"],
        intermediate_size=pick("intermediate_size"),
        num_hidden_layers=int(d.num_hidden_layers),
        num_attention_heads=pick("num_attention_heads"),
        num_key_value_heads=pick("num_key_value_heads"),
        head_dim=pick("head_dim"),
        vocab_size=shape["vocab_size"],
        num_target_layers=shape["num_layers"],
        target_layer_ids=layer_ids,
        mask_token_id=int(mask) if mask is not None else shape["vocab_size"] - 1,
        block_size=int(d.block_size),
        layer_types=list(d.layer_types) if d.layer_types is not None else [],
        sliding_window=d.sliding_window,
        rope_theta=float(d.rope_theta),
    )
