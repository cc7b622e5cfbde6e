"""The chat template a target's prompts are rendered with: the tokenizer's own, a user's template file
(target.chat_template), or, for a base model that has none, a plain "User: ... / Assistant:" format.

The template decides the prompts of regeneration and of evaluation alike, so it is set on the tokenizer once, when
the target is loaded, and every stage renders through `tokenizer.apply_chat_template`.
"""

from __future__ import annotations

import os
from typing import Any

# A plain prompt format for base models: system text first, then "User:" / "Assistant:" turns.
PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}"
    "{% else %}{{ 'Assistant: ' + message['content'] + '\n\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def set_chat_template(tokenizer: Any, template_file: str | None, model_type: str) -> str | None:
    """Give `tokenizer` the template of `template_file` (a Jinja file), or the plain format when it has none;
    returns the one line saying which (None when the tokenizer's own template stays)."""
    if template_file:
        path = os.path.expanduser(template_file)
        with open(path, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
        return f"[target] {model_type}: prompts use the chat template of {path} (target.chat_template)"
    if getattr(tokenizer, "chat_template", None):
        return None
    tokenizer.chat_template = PLAIN_TEMPLATE
    return (f"[target] {model_type} has no chat template (a base model): prompts use the plain format "
            "'User: ...' / 'Assistant:'; set target.chat_template=<file> to give one")
