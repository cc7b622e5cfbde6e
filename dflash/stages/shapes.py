"""The target's shape as the capture stage records it (features/target.json), and the drafter's config built from
the drafter settings with null sizes taken from that shape."""

from __future__ import annotations

from typing import Any

from dflash.config.schema import DrafterSettings, RunSettings

# How the run's log names the token that fills the positions a drafter drafts.
MASK_TOKEN_LABEL = "the drafter's mask token (what fills the positions it drafts):"


def target_shape(adapter) -> dict[str, Any]:
    """What capture records of the target's shape (features/target.json): config_shape of its config, with the
    adapter's own layer count, hidden size and vocabulary (which a multimodal or GDN family's config may nest)."""
    from dflash.models.targets.preflight import config_shape

    shape = config_shape(adapter.config)
    return {
        "model_type": adapter.model_type,
        "num_layers": adapter.num_layers,
        "hidden_size": adapter.hidden_size,
        "vocab_size": adapter.vocab_size,
        **{key: shape[key] for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")},
        # The drafter serves at the target's positions: the export's config carries the target's context length
        # (a serving engine may build its RoPE table from it).
        "max_position_embeddings": shape["max_position_embeddings"],
    }


def check_drafter_fits(d: DrafterSettings, num_layers: int, hidden_size: int) -> None:
    """ConfigError in one line when the drafter settings ask for a hidden size the target does not have, a tap
    outside its layers or named twice, or more taps than the default spread finds distinct layers for: found from
    the target's config before any stage runs where that is readable (dflash/stages/context.py), else when capture
    reads the loaded target's shape."""
    from dflash.config import ConfigError

    if d.hidden_size is not None and int(d.hidden_size) != hidden_size:
        raise ConfigError(f"drafter.hidden_size={d.hidden_size}: the target's hidden size is {hidden_size}, and the "
                          f"drafter shares its embedding and lm_head, so they must be equal (leave it null)")
    if d.target_layer_ids is None:
        if not spread_fits(num_layers, int(d.num_taps)):
            most = max((taps for taps in range(1, int(d.num_taps)) if spread_fits(num_layers, taps)), default=0)
            raise ConfigError(f"drafter.num_taps={d.num_taps}: expected at most {most} for a target of {num_layers} "
                              f"layers (the default spread finds no more distinct ones; drafter.target_layer_ids "
                              f"names the taps)")
        return
    ids = [int(i) for i in d.target_layer_ids]
    outside = [i for i in ids if not 0 <= i < num_layers]
    if outside:
        raise ConfigError(f"drafter.target_layer_ids={ids}: {outside} outside the target's {num_layers} layers "
                          f"(0..{num_layers - 1})")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"drafter.target_layer_ids={ids}: expected distinct layer ids (each tap is one layer's "
                          f"output)")


def spread_fits(num_layers: int, num_taps: int) -> bool:
    """Whether the default spread of `num_taps` taps (drafter_config.default_target_layer_ids) names distinct layers
    of a target of `num_layers` layers."""
    from dflash.models.drafter_config import default_target_layer_ids

    ids = default_target_layer_ids(num_layers, num_taps)
    return len(set(ids)) == len(ids) and all(0 <= i < num_layers for i in ids)


# The drafter settings a refusal of check_drafter_builds may name: those its error message mentions.
DRAFTER_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                      "target_layer_ids", "layer_types", "sliding_window", "block_size", "num_hidden_layers")


def check_drafter_builds(settings: RunSettings, shape: dict[str, Any], target: str) -> None:
    """ConfigError in one line when the drafter settings, with the target's sizes where theirs are null, make no
    drafter for a target of this shape (dflash/models/targets/preflight.config_shape; vocab_size None: not known
    before the target is built), or target.mask_token_id lies outside its vocabulary. `target` names it."""
    from dataclasses import replace

    from dflash.config import ConfigError

    d = settings.drafter
    check_drafter_fits(d, shape["num_layers"], shape["hidden_size"])
    mask, vocab = settings.target.mask_token_id, shape["vocab_size"]
    if mask is not None and vocab is not None and not 0 <= mask < vocab:
        raise ConfigError(f"target.mask_token_id={mask}: outside the vocabulary of {target} (0..{vocab - 1}); "
                          f"leave it null to have one chosen")
    if shape["intermediate_size"] is None and d.intermediate_size is None:
        raise ConfigError(f"drafter.intermediate_size=None: {target} has no dense MLP width to take (a mixture of "
                          f"experts): give the drafter's, e.g. drafter.intermediate_size={4 * shape['hidden_size']}")
    if vocab is None:  # the mask token is checked when the target is built
        settings = replace(settings, target=replace(settings.target, mask_token_id=None))
        shape = {**shape, "vocab_size": 1, "mask_token_id": 0}
    try:
        drafter_config(settings, shape)
    except ValueError as error:
        named = [key for key in DRAFTER_SHAPE_KEYS if key in str(error)]
        given = ", ".join(f"drafter.{key}={getattr(d, key)}" for key in named if getattr(d, key) is not None)
        from_target = any(getattr(d, key) is None for key in named)
        raise ConfigError(f"{given or 'drafter'}: {error}"
                          + (f" (the drafter's sizes left null are those of {target})" if from_target else "")) \
            from error


def drafter_config(settings: RunSettings, shape: dict[str, Any]):
    """The DrafterConfig of a run: the drafter group of its settings, with null fields taken from the target.
    ConfigError names a size or tap the target does not have; ValueError a mask token outside its vocabulary."""
    from dflash.models.drafter_config import DrafterConfig, default_target_layer_ids

    d = settings.drafter
    check_drafter_fits(d, shape["num_layers"], shape["hidden_size"])
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
        # Runs captured before the mask token was chosen (no "mask_token_id" in target.json) keep the last id.
        mask_token_id=int(mask) if mask is not None else int(shape.get("mask_token_id", shape["vocab_size"] - 1)),
        block_size=int(d.block_size),
        layer_types=list(d.layer_types) if d.layer_types is not None else [],
        sliding_window=d.sliding_window,
        rope_theta=float(d.rope_theta),
        # target.json of runs captured before it was recorded: the config's former fixed value.
        max_position_embeddings=int(shape.get("max_position_embeddings", 40960)),
        # The name of the id target.json records, where it records one (a given id is the one it records).
        mask_token=shape.get("mask_token") if mask is None or int(mask) == shape.get("mask_token_id") else None,
    )


def mask_token_for(settings: RunSettings, adapter, used: set[int]) -> tuple[int, str]:
    """(id, one line saying which and why) of the run's MASK token: target.mask_token_id checked against the
    target's vocabulary, chat template and `used` (the data's token ids), or one chosen among the tokenizer's
    special tokens (dflash/models/targets/mask_token.py). ConfigError names a given id that cannot be one."""
    from dflash.config import ConfigError
    from dflash.models.targets.mask_token import choose_mask_token, mask_token_problem

    given = settings.target.mask_token_id
    if given is not None:
        problem = mask_token_problem(int(given), adapter.tokenizer, adapter.vocab_size, used)
        if problem is not None:
            # Answers sampled at T > 0 can draw a special token now and then; the data stage is kept whatever
            # the mask token is, so the rerun that the message names costs no regeneration.
            raise ConfigError(f"target.mask_token_id={given}: {problem}; rerun with target.mask_token_id=null to "
                              "have a free one chosen (the data stage is kept)")
        return int(given), f"{MASK_TOKEN_LABEL} id {given}, target.mask_token_id"
    token_id, why = choose_mask_token(adapter.tokenizer, adapter.vocab_size, used)
    return token_id, (f"{MASK_TOKEN_LABEL} id {token_id}, {why}, which the chat template and the data never produce "
                      f"(chosen; set target.mask_token_id to pick another)")
