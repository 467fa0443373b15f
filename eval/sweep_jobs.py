"""What a sweep job is: its settings, normalized (keys a method ignores dropped, combinations
that make no sense skipped), a stable id and file name for them, and when its file is finished.
``eval/sweep.py`` runs the jobs."""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

METHODS = ("spec", "hf_generate", "hf_assisted", "hf_prompt_lookup")
SCHEDULES = ("constant", "heuristic")
# Keys forwarded to the decoder (eval/decode.py); null means "the decoder's default".
DECODE_KEYS = ("target", "draft", "prompts", "limit", "max_new_tokens", "temperature", "k",
               "tree_size", "top_k", "top_p", "dtype", "device", "seed", "threads")
JOB_KEYS = ("method", "schedule") + DECODE_KEYS
NO_DRAFT = ("none", "null", "")
# drafts without a package; prompt_lookup is an alias of lookup
NO_MODEL_DRAFTS = ("none", "lookup")


def _draft_digest(draft: Path) -> str | None:
    manifest = draft / "manifest.json"
    if manifest.is_file():
        return hashlib.sha256(manifest.read_bytes()).hexdigest()[:16]
    return None


def normalize_settings(raw: Mapping[str, Any]) -> dict | None:
    """Canonical settings of one job, or ``None`` when the combination does not apply.

    Args:
        raw: a mapping with (a subset of) :data:`JOB_KEYS`; other keys are ignored.

    Returns:
        A dict with every job key (unused ones ``None``), paths made absolute,
        ``temperature`` a float and ``k``/``tree_size``/``limit`` ints.

    Raises:
        ValueError: unknown ``method`` or ``schedule``, or a non-numeric number.
    """
    s = {k: raw.get(k) for k in JOB_KEYS}
    method = s["method"] = s["method"] or "spec"
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {METHODS}")
    draft = s["draft"]
    draft = "none" if draft is None or str(draft).lower() in NO_DRAFT else str(draft)
    draft = "lookup" if draft == "prompt_lookup" else draft
    for key in ("k", "tree_size", "limit", "max_new_tokens", "seed", "threads", "top_k"):
        if s[key] is not None:
            try:
                s[key] = int(s[key])
            except (TypeError, ValueError):
                raise ValueError(f"{key}={s[key]!r} must be an integer") from None
    for key in ("temperature", "top_p"):
        if s[key] is not None:
            s[key] = float(s[key])
    if method == "spec":
        s["schedule"] = None
        if draft == "none":
            s["k"] = s["tree_size"] = None
    elif method == "hf_generate":
        draft, s["k"], s["tree_size"], s["schedule"] = "none", None, None, None
    elif method == "hf_assisted":
        if draft in NO_MODEL_DRAFTS:
            return None
        s["tree_size"] = None
        s["schedule"] = s["schedule"] or "constant"
        if s["schedule"] not in SCHEDULES:
            raise ValueError(f"schedule={s['schedule']!r} is not one of {SCHEDULES}")
    elif method == "hf_prompt_lookup":
        draft, s["tree_size"], s["schedule"] = "none", None, None
    if draft not in NO_MODEL_DRAFTS:
        path = Path(draft).expanduser().resolve()
        draft = str(path)
        s["draft_manifest"] = _draft_digest(path)
    s["draft"] = draft
    if s["prompts"] is not None and Path(str(s["prompts"])).expanduser().is_file():
        s["prompts"] = str(Path(str(s["prompts"])).expanduser().resolve())
    return s


def job_id(settings: Mapping[str, Any]) -> str:
    """Stable 12-hex-digit hash of the non-null settings (adding a null key keeps old ids)."""
    canon = {k: v for k, v in settings.items() if v is not None}
    return hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()[:12]


def job_stem(settings: Mapping[str, Any]) -> str:
    """File stem ``<method>-<draft>-k<K>-t<T>-<hash>``, readable and stable."""
    draft = Path(settings["draft"]).name if settings.get("draft") else "none"
    parts = [settings.get("method") or "spec", draft]
    if settings.get("k") is not None:
        parts.append(f"k{settings['k']}")
    if settings.get("temperature") is not None:
        parts.append(f"t{settings['temperature']:g}")
    slug = re.sub(r"[^A-Za-z0-9_.]+", "_", "-".join(parts))[:80]
    return f"{slug}-{job_id(settings)}"


def is_done(path: Path) -> bool:
    """True when ``path`` holds a finished job (JSON with ``summary`` dict and ``samples`` list)."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(obj, dict) and isinstance(obj.get("summary"), dict) \
        and isinstance(obj.get("samples"), list)
