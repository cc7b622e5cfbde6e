"""The MASK token of the drafter's blocks: an id of the target's embedding table that text never produces.

The drafter embeds its block [anchor, MASK, ...] with the target's frozen embedding (method.md §1), so the MASK
is one row of that table; it must lie inside it and never be a token of the chat template or of the training data,
or the drafter could not tell a masked position from a real token. Chosen when not given, in this order: a token
named as a mask (<|mask|>, <mask>, [MASK]), a reserved or unused special token, any other special token that is not
an end, start or padding token, then a row of the embedding table past the tokenizer's last id (padding rows that
no text maps to). Each candidate is checked against the ids of a rendered chat template and of the data.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

MASK_NAMES = re.compile(r"^(<\|mask\|>|<mask>|\[mask\])$", re.IGNORECASE)
RESERVED_NAMES = re.compile(r"reserved|unused", re.IGNORECASE)
# A conversation rendered by the chat template: the ids it puts around messages are never a mask token.
PROBE = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]


def template_ids(tokenizer: Any) -> set[int]:
    """Ids the chat template produces around a short conversation (empty without a template)."""
    if not getattr(tokenizer, "chat_template", None):
        return set()
    found: set[int] = set()
    for messages in (PROBE, PROBE[1:]):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 (a template that refuses a system turn or our roles: try the next)
            continue
        found.update(int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"])
    return found


def _reserved_ids(tokenizer: Any) -> set[int]:
    """Ids the tokenizer itself uses around text: bos, eos, pad, unk and its end-of-turn tokens."""
    ids = {getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk", "sep", "cls")}
    return {int(i) for i in ids if i is not None}


def candidates(tokenizer: Any, vocab_size: int) -> list[tuple[int, str]]:
    """(id, why) in the order of preference (module docstring), ids inside [0, vocab_size)."""
    special = {int(i): str(t) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    for token, token_id in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids):
        special.setdefault(int(token_id), str(token))
    special = {i: t for i, t in special.items() if 0 <= i < vocab_size and i not in _reserved_ids(tokenizer)}
    ordered = sorted(special.items())
    found = [(i, f"{t!r}, a mask token of the tokenizer") for i, t in ordered if MASK_NAMES.match(t)]
    found += [(i, f"{t!r}, a reserved special token") for i, t in ordered if RESERVED_NAMES.search(t)]
    found += [(i, f"{t!r}, a special token") for i, t in ordered]
    found += [(i, "a row of the embedding table past the tokenizer's last id") for i in range(len(tokenizer),
                                                                                             vocab_size)][:1]
    return found


def choose_mask_token(tokenizer: Any, vocab_size: int, used: Iterable[int]) -> tuple[int, str]:
    """(id, why) of the first candidate that neither the chat template nor `used` (the data's ids) holds;
    ValueError naming what was tried when none is free."""
    taken = set(used) | template_ids(tokenizer)
    options = candidates(tokenizer, vocab_size)
    for token_id, why in options:
        if token_id not in taken:
            return token_id, why
    raise ValueError(f"no free mask token: the {len(options)} special tokens of the tokenizer are all produced by "
                     "the chat template or the data, and the embedding table has no row past the tokenizer; set "
                     "target.mask_token_id to an id that text never produces")


def mask_token_name(tokenizer: Any, token_id: int) -> str | None:
    """The text of `token_id` in the tokenizer, where looking that text up gives the id back (what an engine that
    resolves the mask token by name finds); None for a row past the tokenizer's last id or a text of another id."""
    if not 0 <= token_id < len(tokenizer):
        return None
    name = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(name, str) or not name or tokenizer.convert_tokens_to_ids(name) != token_id:
        return None
    return name


def mask_token_problem(token_id: int, tokenizer: Any, vocab_size: int, used: Iterable[int] = ()) -> str | None:
    """Why `token_id` cannot be the mask token (outside the vocabulary, made by the template or the data), or None."""
    if not 0 <= token_id < vocab_size:
        return f"outside the target's vocabulary (0..{vocab_size - 1})"
    name = tokenizer.convert_ids_to_tokens(token_id) if token_id < len(tokenizer) else None
    if token_id in template_ids(tokenizer):
        return f"{name!r} is produced by the chat template"
    if token_id in set(used):
        return f"{name!r} occurs in the training data"
    return None
