"""Configuration of a DFlash drafter, and its z-lab `config.json` form.

The z-lab checkpoints are Qwen3 configs with a few extra keys (method.md §3); `block_size` sits at the top
level in old checkpoints and inside `dflash_config` in new ones, so both are written and both are read. The target's
final logit transform (models/targets/logit_transform.py), which the drafter's logits go through as the target's do,
is written as the reference's `output_multiplier` and `final_logit_softcapping` (in `dflash_config`) when it is not
the identity.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dflash.models.targets.logit_transform import LogitTransform

LAYER_TYPES = ("full_attention", "sliding_attention")


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Spread `num_taps` taps from layer 1 to layer N-3 (method.md §2), e.g. 64 layers -> [1,16,31,46,61]."""
    if num_taps < 1:
        raise ValueError(f"num_taps must be >= 1, got {num_taps}")
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_taps - 1)) for i in range(num_taps)]


# Options of newer reference drafters that change what the drafter computes (the reference reads each from
# dflash_config, else from the top level), with the test for the value that leaves them off. DFlashDraftModel has
# none of them: a drafter trained with one on would load here and draft differently. (The reference's
# output_multiplier and final_logit_softcapping are the logit transform, which DrafterConfig holds.)
REFERENCE_OPTIONS_OFF = {
    "input_embedding_scale": lambda value: float(value) == 1.0,  # scales the block's token embeddings
}


def reference_option(config: dict[str, Any], name: str) -> Any:
    """A reference option of a z-lab `config`: from dflash_config, else from the top level (None when unset)."""
    dflash = config.get("dflash_config") or {}
    return dflash[name] if name in dflash else config.get(name)


def check_unsupported_options(config: dict[str, Any]) -> None:
    """ValueError naming every reference option that `config` (z-lab form) sets to a value that is not off."""
    dflash = config.get("dflash_config") or {}
    found = [f"{where}{name}={source[name]!r}" for where, source in (("dflash_config.", dflash), ("", config))
             for name, is_off in REFERENCE_OPTIONS_OFF.items() if name in source and not is_off(source[name])]
    if found:
        raise ValueError(f"drafter config sets {', '.join(found)}: reference drafter options that DFlashDraftModel "
                         f"does not implement (it would draft differently from the published model)")
    # is_causal (the reference's) or causal (vLLM's), when set, makes every layer causal (True) or bidirectional
    # (False); unset, sliding layers are causal and full ones bidirectional, the only layout DFlashDraftModel has.
    for name in ("is_causal", "causal"):
        causal = config.get(name, dflash.get(name))
        if causal is None:
            continue
        layer_types = config.get("layer_types") or ["full_attention"] * int(config.get("num_hidden_layers", 0))
        differ = [i for i, kind in enumerate(layer_types) if bool(causal) != (kind == "sliding_attention")]
        if differ:
            raise ValueError(f"drafter config sets {name}={causal!r}, which makes layers {differ} "
                             f"{'causal' if causal else 'bidirectional'}; DFlashDraftModel makes sliding layers "
                             f"causal and full ones bidirectional (it would draft differently)")
    architectures = config.get("architectures")
    if architectures is not None and list(architectures) != ["DFlashDraftModel"]:
        raise ValueError(f"drafter config names architectures {architectures!r}, not ['DFlashDraftModel']: not a "
                         f"DFlash drafter")
    # What the reference and the serving engines read and DFlashDraftModel does not: another activation, a scaled
    # RoPE, vLLM's own sliding-window switch (this drafter's windows are its layer_types and sliding_window).
    rope_types = [(key, rope.get(field)) for key in ("rope_parameters", "rope_scaling")
                  if isinstance(rope := config.get(key), dict) for field in ("rope_type", "type")]
    other = [f"{key}.{kind}" for key, kind in rope_types if kind not in (None, "default")]
    if config.get("hidden_act", "silu") != "silu":
        other.append(f"hidden_act={config['hidden_act']!r}")
    if reference_option(config, "use_swa"):
        other.append(f"use_swa={reference_option(config, 'use_swa')!r}")
    if other:
        raise ValueError(f"drafter config sets {', '.join(other)}: DFlashDraftModel has plain RoPE, SiLU and the "
                         f"sliding windows of its layer_types only (it would draft differently from the published "
                         f"model)")


def zlab_sliding_window(config: dict[str, Any], layer_types: list[str]) -> int | None:
    """The window of a z-lab config's sliding layers (None when it has none); ValueError when it has some but not
    use_sliding_window true."""
    if "sliding_attention" not in layer_types:
        return None
    # Hugging Face's Qwen3Config, which the serving engines and the reference read the config with, drops
    # sliding_window unless use_sliding_window is true (its default is false): the layers would have no window.
    if not config.get("use_sliding_window", False):
        sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
        raise ValueError(f"drafter config has sliding_attention layers {sliding} but use_sliding_window="
                         f"{config.get('use_sliding_window')!r}: Hugging Face's Qwen3Config then drops sliding_window="
                         f"{config.get('sliding_window')!r}, so those layers would have no window")
    return config.get("sliding_window")


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    # The target's final logit transform, which the drafter's logits go through: a scale, then a soft cap.
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # The MASK token's text in the target's tokenizer (None: not recorded): SGLang before it read mask_token_id
    # looked the token up by this name, adding "<|MASK|>" (a new id) when it was not given.
    mask_token: str | None = None

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.layer_types = list(self.layer_types) or ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"unknown layer_types {unknown}; known: {list(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a positive sliding_window")
        sliding = "sliding_attention" in self.layer_types  # without such a layer the window is never read
        if sliding and self.sliding_window < self.block_size:
            # A sliding query must at least see its own anchor, which is up to block_size-1 positions back.
            raise ValueError(f"sliding_window {self.sliding_window} is smaller than block_size {self.block_size}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} is odd: the drafter's RoPE rotates pairs of dimensions")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        if any(a >= b for a, b in zip(self.target_layer_ids, self.target_layer_ids[1:])):
            # The features are joined in the order listed; vLLM and SGLang join them in layer order as their target
            # runs its layers, so a drafter of any other order would be served its fc input permuted.
            raise ValueError(f"target_layer_ids {self.target_layer_ids} are not distinct and ascending: serving "
                             f"engines join the taps' features in layer order")
        for layer_id in self.target_layer_ids:
            if not 0 <= layer_id < self.num_target_layers:
                raise ValueError(
                    f"target layer id {layer_id} is out of range for a target with {self.num_target_layers} "
                    f"layers (valid: 0..{self.num_target_layers - 1})"
                )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the target vocabulary (size {self.vocab_size})"
            )
        softcap = self.final_logit_softcapping
        if not self.output_multiplier > 0 or (softcap is not None and not softcap > 0):
            raise ValueError(f"output_multiplier must be > 0 and final_logit_softcapping > 0 or None, got "
                             f"{self.output_multiplier} and {softcap}")

    @property
    def logit_transform(self) -> LogitTransform:
        return LogitTransform(scale=float(self.output_multiplier), softcap=self.final_logit_softcapping)

    def with_logit_transform(self, transform: LogitTransform) -> "DrafterConfig":
        """This config with the target's final logit `transform`."""
        return replace(self, output_multiplier=transform.scale, final_logit_softcapping=transform.softcap)

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def to_zlab(self) -> dict[str, Any]:
        """The `config.json` that vLLM (`method: dflash`), SGLang (`DFLASH`) and the reference code read."""
        uses_sliding = "sliding_attention" in self.layer_types
        config = {
            "architectures": ["DFlashDraftModel"],
            # As the published drafters have it: Transformers' AutoModel with trust_remote_code then asks for the
            # reference's dflash.py beside the weights instead of building a plain Qwen3Model from them.
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "layer_types": list(self.layer_types),
            "use_sliding_window": uses_sliding,
            "sliding_window": self.sliding_window if uses_sliding else None,
            "max_window_layers": self.num_hidden_layers,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "block_size": self.block_size,
            },
            "dtype": "bfloat16",
        }
        # Only a transform that does something is written: the configs of other targets stay as they were.
        if self.output_multiplier != 1.0:
            config["dflash_config"]["output_multiplier"] = float(self.output_multiplier)
        if self.final_logit_softcapping is not None:
            config["dflash_config"]["final_logit_softcapping"] = float(self.final_logit_softcapping)
        if self.mask_token is not None:
            config["dflash_config"]["mask_token"] = self.mask_token
        return config

    @classmethod
    def from_zlab(cls, config: dict[str, Any]) -> "DrafterConfig":
        """Read a z-lab `config.json`; ValueError when it turns on a reference option this drafter lacks."""
        dflash = config.get("dflash_config") or {}
        check_unsupported_options(config)
        rope = config.get("rope_parameters") or {}
        num_layers = config["num_hidden_layers"]
        layer_types = config.get("layer_types") or ["full_attention"] * num_layers
        target_layer_ids = dflash.get("target_layer_ids", config.get("target_layer_ids"))
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(config["num_target_layers"], num_layers)
        mask_token_id = dflash.get("mask_token_id", config.get("mask_token_id"))
        if mask_token_id is None:
            raise ValueError("drafter config has no mask_token_id (expected in dflash_config)")
        multiplier = reference_option(config, "output_multiplier")
        softcap = reference_option(config, "final_logit_softcapping")
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config["num_key_value_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            vocab_size=config["vocab_size"],
            num_target_layers=config["num_target_layers"],
            target_layer_ids=target_layer_ids,
            mask_token_id=mask_token_id,
            block_size=int(dflash.get("block_size", config.get("block_size", 16))),
            layer_types=layer_types,
            sliding_window=zlab_sliding_window(config, layer_types),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 1_000_000.0))),
            max_position_embeddings=config.get("max_position_embeddings", 40960),
            output_multiplier=float(multiplier) if multiplier is not None else 1.0,
            # A cap of 0 or less is off, as in the reference.
            final_logit_softcapping=float(softcap) if softcap is not None and float(softcap) > 0 else None,
            mask_token=dflash.get("mask_token"),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
