"""Random-weight tiny targets for tests and CPU runs, with a tokenizer that needs no download.

Families: "llama" (dense, SmolLM-like, tied embeddings), "qwen3" (dense), "mistral" (dense, every layer a sliding
window of 8), "qwen3_5" (Qwen3.5/3.6 text: GDN hybrid with full attention every 4th layer, method.md §7),
"qwen3_5_moe" and "qwen3_next" (GDN hybrids with MoE), and families the generic adapter takes: gemma2 and
gemma3_text (final-logit soft-capping, sliding windows), granite (logits scaling), cohere (logit scale), phi3,
olmo2, stablelm, glm4, gpt_oss (sinks, sliding windows, MoE) and deepseek_v3 (MLA, MoE).
The tokenizer is the cached SmolLM2 tokenizer when present ("auto"), or a built-in byte-level ChatML tokenizer
("builtin", always available and deterministic: tests use it).
"""

from __future__ import annotations

from typing import Any

import torch

from dflash.models.targets.base import TargetAdapter, resolve_dtype

BUILTIN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
# Never produced by the built-in tokenizer from text: a valid DFlash mask_token_id for tiny runs.
BUILTIN_MASK_TOKEN = "<|mask|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_DENSE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=4096,
)
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)

# family -> (transformers config class name, default config kwargs)
TINY_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {**_DENSE, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", dict(_DENSE)),
    "mistral": ("MistralConfig", {**_DENSE, "sliding_window": 8}),
    "qwen3_5": ("Qwen3_5TextConfig", {**_DENSE, **_GDN}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", {**_DENSE, **_GDN, **_MOE}),
    "qwen3_next": ("Qwen3NextConfig", {**_DENSE, **_GDN, **_MOE}),
    "gemma2": ("Gemma2Config", {**_DENSE, "sliding_window": 8}),
    "gemma3_text": ("Gemma3TextConfig", {**_DENSE, "sliding_window": 8, "final_logit_softcapping": 30.0}),
    "granite": ("GraniteConfig", {**_DENSE, "logits_scaling": 4.0}),
    "cohere": ("CohereConfig", {**_DENSE, "logit_scale": 0.5}),
    "phi3": ("Phi3Config", {**_DENSE, "tie_word_embeddings": False}),
    "olmo2": ("Olmo2Config", dict(_DENSE)),
    "stablelm": ("StableLmConfig", dict(_DENSE)),
    "glm4": ("Glm4Config", dict(_DENSE)),
    "gpt_oss": ("GptOssConfig", {**_DENSE, "sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "deepseek_v3": ("DeepseekV3Config", {**_DENSE, "num_key_value_heads": 4, "n_routed_experts": 4,
                                         "num_experts_per_tok": 2, "moe_intermediate_size": 32, "kv_lora_rank": 16,
                                         "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                                         "v_head_dim": 16, "first_k_dense_replace": 1, "n_group": 1,
                                         "topk_group": 1}),
}
TINY_TOKENIZERS = ("auto", "builtin", "smollm2")
# The keys of a tiny spec that build_tiny_target reads itself; any other overrides a field of the family's config.
TINY_SPEC_KEYS = ("family", "seed", "tokenizer")
# The sizes every family sets, and the vocabulary's: the preflight reads them as ints (preflight.config_shape).
TINY_SIZES = (*_DENSE, "vocab_size")


def _byte_symbols() -> list[str]:
    """The printable symbol the byte-level pre-tokenizer uses for each byte 0..255, in byte order.

    Printable Latin-1 bytes stand for themselves; the others are shifted to code points from 256 up.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    symbols, shift = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shift))
            shift += 1
    return symbols


def build_builtin_tokenizer() -> Any:
    """A byte-level ChatML tokenizer (4 special tokens + 256 bytes) built in memory, no files needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(BUILTIN_SPECIAL_TOKENS)}
    for symbol in _byte_symbols():
        vocab[symbol] = len(vocab)
    # No merges: every byte is one token, so any text round-trips.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[BUILTIN_MASK_TOKEN],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_tokenizer(kind: str = "auto", cache_dir: str | None = None) -> Any:
    """The tokenizer of a tiny target: "builtin", "smollm2" (the cached one, else FileNotFoundError) or "auto"."""
    from dflash.models.targets import smollm2

    if kind not in TINY_TOKENIZERS:
        raise ValueError(f"unknown tiny tokenizer {kind!r}; use 'auto', 'builtin' or 'smollm2'")
    if kind == "builtin" or (kind == "auto" and not smollm2.is_cached(cache_dir)):
        return build_builtin_tokenizer()
    folder = smollm2.cache_path(cache_dir)
    if not smollm2.is_cached(cache_dir):
        raise FileNotFoundError(f"no cached SmolLM2 tokenizer at {folder}; load_target('smollm2') creates it")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def check_tiny_spec(spec: dict[str, Any], cache_dir: str | None = None) -> None:
    """ConfigError in one line naming the key of target.tiny (`spec`) that builds no tiny target: a family or
    tokenizer it does not know (or a SmolLM2 tokenizer not cached under `cache_dir`), a seed that is not an int, a
    size that is not an int >= 1, a vocab_size below the tokenizer's size, or a key that is no field of the family's
    transformers config."""
    import difflib

    import transformers

    from dflash.config.errors import ConfigError, require, require_choice
    from dflash.models.targets import smollm2

    require_choice("target.tiny.family", spec.get("family"), sorted(TINY_FAMILIES))
    seed = spec.get("seed", 0)
    require(isinstance(seed, int) and not isinstance(seed, bool), "target.tiny.seed", seed, "an int")
    tokenizer = spec.get("tokenizer", "auto")
    require_choice("target.tiny.tokenizer", tokenizer, TINY_TOKENIZERS)
    require(tokenizer != "smollm2" or smollm2.is_cached(cache_dir), "target.tiny.tokenizer", tokenizer,
            f"'auto' or 'builtin': no SmolLM2 tokenizer is cached in {smollm2.cache_path(cache_dir)} (a run of "
            f"target=smollm2 converts it)")
    config_name, defaults = TINY_FAMILIES[spec["family"]]
    config_class = getattr(transformers, config_name)
    config = config_class()
    for key, value in spec.items():
        if key in ("dtype", "device"):  # build_tiny_target's own arguments, which the run's settings give
            raise ConfigError(f"target.tiny.{key}={value!r}: set by {'target.dtype' if key == 'dtype' else 'device'}"
                              f", not by target.tiny")
        known = key in TINY_SPEC_KEYS or key in defaults or hasattr(config, key) or key == "attn_implementation"
        if not known and not _config_takes(config_class, key, value):
            fields = [name for name in vars(config) if not name.startswith("_")]
            near = difflib.get_close_matches(key, [*TINY_SPEC_KEYS, *fields], n=1)
            raise ConfigError(f"target.tiny.{key}={value!r}: expected one of {', '.join(TINY_SPEC_KEYS)} or a field "
                              f"of transformers' {config_name}"
                              + (f" (did you mean target.tiny.{near[0]}?)" if near else ""))
        if key in TINY_SIZES:
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, f"target.tiny.{key}",
                    value, "an int >= 1")
    if "vocab_size" in spec:
        # Every token id of the tokenizer needs a row of the embedding (build_tiny_target raises too, for its own
        # callers; here it is found before the run folder is made).
        needed = len(tiny_tokenizer(tokenizer, cache_dir))
        require(spec["vocab_size"] >= needed, "target.tiny.vocab_size", spec["vocab_size"],
                f"an int >= {needed}, the size of the tiny target's tokenizer")


def _config_takes(config_class: Any, key: str, value: Any) -> bool:
    """Whether the config's constructor reads argument `key` into other fields (transformers 5 folds rope_theta into
    rope_parameters): a key it does not know is only kept as an attribute of that name."""
    try:
        made = config_class(**{key: value}).to_dict()
    except (TypeError, ValueError):  # it read the key and refused the value: loading the target says why
        return True
    base = config_class().to_dict()
    return any(made.get(name) != base.get(name) for name in set(made) | set(base) if name != key)


def build_tiny_target(
    family: str,
    seed: int = 0,
    *,
    tokenizer: str = "auto",
    cache_dir: str | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    **overrides: Any,
) -> TargetAdapter:
    """A random-weight tiny target of `family`; `overrides` replace config fields (e.g. num_hidden_layers=12)."""
    import transformers
    from transformers import AutoModelForCausalLM

    from dflash.models.targets.registry import wrap_model

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny target family {family!r}; known: {sorted(TINY_FAMILIES)}")
    torch_dtype = resolve_dtype(dtype, device)
    tok = tiny_tokenizer(tokenizer, cache_dir)
    config_name, defaults = TINY_FAMILIES[family]
    # Round the vocabulary up to a multiple of 64 so matmuls stay aligned.
    needed = len(tok)
    kwargs = {**defaults, "vocab_size": (needed + 63) // 64 * 64, **overrides}
    if kwargs["vocab_size"] < needed:
        raise ValueError(f"vocab_size {kwargs['vocab_size']} is smaller than the tokenizer's {needed} tokens")
    kwargs.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = getattr(transformers, config_name)(**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.to(device=device, dtype=torch_dtype)
    return wrap_model(model, tok)
