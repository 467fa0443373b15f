"""Conversations -> token ids with an assistant-only loss mask, and a stable train/val/test split.

Assistant spans are found from the tokenizer's chat template (its own, or the format
``load_target`` gave it: ``target.chat_template``) without relying on
``{% generation %}`` markers: for each assistant message at index ``i`` the conversation is rendered
up to ``i`` with the generation prompt, and up to ``i + 1``; the text between the two renders is
the assistant's reply (its content and end-of-turn token). The full rendering is tokenized once with
character offsets, and a token is an assistant token when it starts inside such a span.

``loss_mask[t]`` is True when token ``t`` belongs to an assistant reply, i.e. the prediction made
at position ``t - 1`` is trained.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from draftsmith.data.sharegpt import Conversation

SPLITS = ("train", "val", "test")
_PART_SUFFIX = re.compile(r"_\d+$")


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used to locate assistant replies."""


@dataclass
class TokenizeReport:
    """Counts from tokenizing a set of conversations."""

    conversations: int = 0
    kept: int = 0
    truncated: int = 0
    tokens: int = 0
    assistant_tokens: int = 0
    dropped: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        return {"conversations": self.conversations, "kept": self.kept,
                "truncated": self.truncated, "tokens": self.tokens,
                "assistant_tokens": self.assistant_tokens, "dropped": dict(self.dropped)}


def _render(tokenizer: Any, messages: Sequence[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer: Any, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation and locate the character spans of the assistant replies.

    Args:
        tokenizer: A tokenizer with a chat template.
        messages: ``[{"role", "content"}, ...]``.

    Returns:
        The full rendered text and the ``[start, end)`` character spans of assistant replies
        (content plus end-of-turn marker, trailing whitespace excluded).

    Raises:
        ChatTemplateError: no chat template, or renders of prefixes are not prefixes of the whole.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the tokenizer has no chat template; load the target with "
                                "data.target.load_target (a base model then gets the plain "
                                "completion format, see target.chat_template) or set "
                                "tokenizer.chat_template")
    full = _render(tokenizer, messages, False)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant" or not msg["content"]:
            continue
        upto = _render(tokenizer, messages[: i + 1], False)
        if not full.startswith(upto):
            raise ChatTemplateError(
                "the chat template is not prefix-stable (rendering the first "
                f"{i + 1} messages is not a prefix of the whole conversation)")
        end = len(upto.rstrip())
        prompt = _render(tokenizer, messages[:i], True) if i > 0 else ""
        if i > 0 and upto.startswith(prompt) and len(prompt) < end:
            start = len(prompt)
        else:  # e.g. a leading assistant turn: find its content at the end of the render
            start = upto.rfind(msg["content"], 0, end)
            if start < 0:  # a template that trims the content (the plain format does)
                start = upto.rfind(msg["content"].strip(), 0, end)
            if start < 0:
                raise ChatTemplateError(f"cannot find assistant message {i} in the rendered text")
        spans.append((start, end))
    return full, spans


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict],
                          max_length: int | None = None) -> tuple[list[int], list[bool], bool]:
    """Token ids and assistant loss mask of one conversation.

    Args:
        tokenizer: A fast tokenizer (offsets mapping) with a chat template.
        messages: ``[{"role", "content"}, ...]``.
        max_length: Keep at most this many tokens (from the start).

    Returns:
        ``(input_ids (T,), loss_mask (T,), truncated)``.
    """
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=bool)
    for s, e in spans:
        mask |= (starts >= s) & (starts < e)
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask.tolist(), truncated


def tokenize_conversations(conversations: Iterable[Conversation], tokenizer: Any,
                           max_length: int | None = None):
    """Tokenize conversations into a `datasets.Dataset` with ``id, input_ids, loss_mask``.

    Conversations without any assistant token (after truncation) are dropped, and so are empty
    ones (regeneration leaves a conversation empty when it has nothing to answer).

    Returns:
        ``(dataset, TokenizeReport)``.
    """
    from datasets import Dataset

    given = list(conversations)
    convs = [c for c in given if c.messages]
    report = TokenizeReport(conversations=len(given))
    if not getattr(tokenizer, "is_fast", False):
        raise ChatTemplateError("assistant masks need a fast tokenizer (offsets mapping)")
    raw = Dataset.from_dict({"id": [c.id for c in convs],
                             "messages": [c.messages for c in convs]})

    def encode(row: dict) -> dict:
        ids, mask, truncated = tokenize_conversation(tokenizer, row["messages"], max_length)
        return {"input_ids": ids, "loss_mask": mask, "truncated": truncated,
                "n_assistant": int(sum(mask))}

    # in this process (datasets 5 runs num_proc=1 in a worker process, pickling the tokenizer
    # there), under a fingerprint of its own: datasets would derive one by pickling ``encode``
    # and the tokenizer, seconds per call for a 262k vocabulary (the dataset is in memory only)
    fingerprint = hashlib.sha256(json.dumps(
        [[c.id for c in convs], max_length, tokenizer.chat_template,
         getattr(tokenizer, "name_or_path", "")]).encode()).hexdigest()[:16]
    enc = raw.map(encode, remove_columns=["messages"], num_proc=None, desc="tokenize",
                  new_fingerprint=fingerprint)
    n_assistant = np.asarray(enc["n_assistant"], dtype=np.int64)
    keep = np.nonzero(n_assistant > 0)[0]
    report.dropped["no_assistant_tokens"] = int(len(convs) - len(keep))
    report.dropped["empty"] = len(given) - len(convs)
    enc = enc.select(keep.tolist())
    report.kept = len(enc)
    report.truncated = int(np.sum(enc["truncated"])) if len(enc) else 0
    report.tokens = int(sum(len(x) for x in enc["input_ids"]))
    report.assistant_tokens = int(n_assistant[keep].sum())
    return enc.remove_columns(["truncated", "n_assistant"]), report


def split_key(conv_id: str) -> str:
    """The id the split hashes: ShareGPT parts ``abc_0, abc_1`` of one chat share ``abc``."""
    return _PART_SUFFIX.sub("", conv_id)


def split_of(conv_id: str, val: float, test: float) -> str:
    """Deterministic split of a conversation id: depends on the id only.

    Args:
        conv_id: Conversation id.
        val: Fraction for validation.
        test: Fraction for test.

    Returns:
        ``"train"``, ``"val"`` or ``"test"``.
    """
    if not (0 <= val and 0 <= test and val + test < 1):
        raise ValueError(
            f"split fractions need 0 <= val, test and val + test < 1; got {val}, {test}")
    digest = hashlib.sha256(split_key(conv_id).encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    if u < test:
        return "test"
    return "val" if u < test + val else "train"


def split_conversations(conversations: Iterable[Conversation], val: float,
                        test: float) -> dict[str, list[Conversation]]:
    """Group conversations by `split_of` (order preserved within each split)."""
    out: dict[str, list[Conversation]] = {s: [] for s in SPLITS}
    for c in conversations:
        out[split_of(c.id, val, test)].append(c)
    return out
