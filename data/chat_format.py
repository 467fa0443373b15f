"""Chat formats of targets: the tokenizer's own template, a given one, or a plain completion
format for base models that have none."""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

# The chat format of base models (a tokenizer without a chat template): plain turns, each reply
# closed by the end-of-sequence token, the generation prompt "Assistant:" (no trailing space: a
# reply's first token carries its own leading space, as it does inside a rendered conversation).
PLAIN_CHAT_TEMPLATE = (
    "{%- if bos_token %}{{ bos_token }}{% endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{ message['content'] | trim }}{{ '\\n\\n' }}"
    "{%- elif message['role'] == 'user' -%}"
    "{{ 'User: ' }}{{ message['content'] | trim }}{{ '\\n\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ 'Assistant: ' }}{{ message['content'] | trim }}{{ eos_token }}{{ '\\n\\n' }}"
    "{%- else -%}"
    "{{ raise_exception('the plain chat format knows the roles system, user and assistant, "
    "not ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ 'Assistant:' }}{% endif -%}"
)
# Where a base model's reply in the plain format ends when it writes no end-of-sequence token:
# at the next turn it invents (regeneration stops there and cuts the reply).
PLAIN_STOP_STRINGS = ("\nUser:", "\nAssistant:")


def check_chat_template(chat_template: str | None) -> None:
    """Raise ValueError unless ``chat_template`` is None, ``"plain"`` or a Jinja template."""
    if chat_template is None or chat_template == "plain":
        return
    if not isinstance(chat_template, str) or ("{{" not in chat_template
                                              and "{%" not in chat_template):
        raise ValueError(
            f"target.chat_template={chat_template!r} is not a chat format: use null (the "
            "tokenizer's own template, or the plain completion format for a base model), "
            "'plain' (the plain completion format) or a Jinja chat template string")


def apply_chat_format(tokenizer: Any, chat_template: str | None = None,
                      name: str = "the target") -> str:
    """Give ``tokenizer`` the chat template that ``target.chat_template`` selects.

    Args:
        tokenizer: The target's tokenizer (changed in place).
        chat_template: None: the tokenizer's own template, or :data:`PLAIN_CHAT_TEMPLATE` when it
            has none (a base model); ``"plain"``: :data:`PLAIN_CHAT_TEMPLATE` always; any other
            string: a Jinja chat template used as is.
        name: The target's name, for the log line.

    Returns:
        ``"tokenizer"``, ``"plain"`` or ``"custom"``: the format now set.

    Raises:
        ValueError: ``chat_template`` is neither None, ``"plain"`` nor a Jinja template.
    """
    check_chat_template(chat_template)
    own = getattr(tokenizer, "chat_template", None)
    if chat_template is None and own:
        fmt, why = "tokenizer", "its own chat template"
    elif chat_template is None:
        fmt, why = "plain", ("the plain completion format (User: / Assistant: turns), since the "
                             "tokenizer has no chat template (a base model)")
    elif chat_template == "plain":
        fmt, why = "plain", "the plain completion format, as target.chat_template=plain asks"
    else:
        fmt, why = "custom", "the Jinja template given as target.chat_template"
    if fmt == "plain":
        tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    elif fmt == "custom":
        tokenizer.chat_template = chat_template
    log.info("chat format of %s: %s", name, why)
    return fmt
