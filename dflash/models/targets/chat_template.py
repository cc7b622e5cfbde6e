"""The chat template a target's prompts are rendered with: the tokenizer's own, a user's template file
(target.chat_template), or, for a base model that has none, a plain "User: ... / Assistant:" format.

The template decides the prompts of regeneration and of evaluation alike, so it is set on the tokenizer once, when
the target is loaded, and every stage renders through `tokenizer.apply_chat_template`. Prompts are tokenized without
special tokens (data/chat.py), so a BOS token comes only from the template: the plain format starts with it when the
tokenizer itself puts one before plain text (Gemma, Llama), and a template file that lacks it there is warned about.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# A plain prompt format for base models: system text first, then "User:" / "Assistant:" turns.
PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}"
    "{% else %}{{ 'Assistant: ' + message['content'] + '\n\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# The plain format for a tokenizer that puts its BOS token before plain text (a model trained on text that starts
# with it, such as Gemma 3, degenerates without it).
PLAIN_TEMPLATE_WITH_BOS = "{{ bos_token }}" + PLAIN_TEMPLATE
PLAIN_TEMPLATES = (PLAIN_TEMPLATE, PLAIN_TEMPLATE_WITH_BOS)
# Where an answer in the plain format ends: a base model has no end-of-turn token, so after its answer it goes on
# with the conversation's next turn, which is made-up text, not the answer.
PLAIN_ANSWER_END = "\n\nUser:"

# The file a run's data stage and its exports hold the template in, where a serving engine would not use it by itself.
TEMPLATE_FILE = "chat_template.jinja"

# Template files already warned about (a target is loaded again by later stages).
_warned_without_bos: set[str] = set()


def adds_bos(tokenizer: Any) -> bool:
    """Whether `tokenizer` puts its BOS token before plain text when it adds special tokens."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("x").input_ids
    return len(ids) > 0 and ids[0] == bos


def starts_with_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a user turn starting with the BOS token."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                         add_generation_prompt=True)
    return text.startswith(tokenizer.bos_token)


def answer_stop_strings(tokenizer: Any) -> list[str]:
    """The texts that end an answer besides the stop tokens: the next turn of the plain format, else none."""
    return [PLAIN_ANSWER_END] if getattr(tokenizer, "chat_template", None) in PLAIN_TEMPLATES else []


def template_to_record(tokenizer: Any, template_file: str | None) -> str | None:
    """The template `tokenizer` renders prompts with where a serving engine would not use it by itself (a user's
    template file, or the plain format of a base model); None where it is the tokenizer's own."""
    template = getattr(tokenizer, "chat_template", None)
    return template if template_file or template in PLAIN_TEMPLATES else None


def template_file_problem(template_file: str, template_kwargs: dict[str, Any] | None = None) -> str | None:
    """Why the Jinja file `template_file` is no chat template, in a phrase: it is not UTF-8 text, does not parse, or
    renders a conversation of one user turn without the turn's text (a file of plain text parses as a template that
    ignores every message). None when it renders one, and where rendering fails otherwise: without the tokenizer's
    special tokens (rendered here as empty strings) and the run's own conversations a template may rightly fail here
    (one that needs a system turn, or a token or argument this probe lacks), and the stage that renders says why.
    template_kwargs: the chat template's options the command gives (data.chat_template_kwargs)."""
    from jinja2 import TemplateError, TemplateSyntaxError
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        with open(os.path.expanduser(template_file), encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as error:
        return f"not UTF-8 text ({error.reason} at byte {error.start})"
    probe = "dflash-checks-this-user-turn"
    special = {name: "" for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    try:
        rendered, _ = render_jinja_template([[{"role": "user", "content": probe}]], chat_template=text,
                                            add_generation_prompt=True, **{**special, **(template_kwargs or {})})
    except TemplateSyntaxError as error:
        return f"not a Jinja template: line {error.lineno}: {error.message}"
    except TemplateError:
        return None
    if probe not in rendered[0]:
        return ("renders a conversation without its messages' text (a chat template writes each message's "
                "content, e.g. {% for message in messages %}{{ message['content'] }}{% endfor %})")
    return None


def set_chat_template(tokenizer: Any, template_file: str | None, model_type: str) -> str | None:
    """Give `tokenizer` the template of `template_file` (a Jinja file), or the plain format when it has none;
    returns the one line saying which (None when the tokenizer's own template stays)."""
    if template_file:
        path = os.path.expanduser(template_file)
        with open(path, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
        if adds_bos(tokenizer) and not starts_with_bos(tokenizer) and path not in _warned_without_bos:
            _warned_without_bos.add(path)
            logger.warning(f"[target] warning: the chat template {path} (target.chat_template) does not start with "
                           f"the BOS token {tokenizer.bos_token!r}, which the {model_type} tokenizer puts before "
                           f"plain text; prompts are tokenized without special tokens, so they will lack it")
        return f"[target] {model_type}: prompts use the chat template of {path} (target.chat_template)"
    if getattr(tokenizer, "chat_template", None):
        return None
    bos = tokenizer.bos_token if adds_bos(tokenizer) else ""
    tokenizer.chat_template = PLAIN_TEMPLATE_WITH_BOS if bos else PLAIN_TEMPLATE
    return (f"[target] {model_type} has no chat template (a base model): prompts use the plain format "
            f"'{bos}User: ...' / 'Assistant:'; set target.chat_template=<file> to give one")
