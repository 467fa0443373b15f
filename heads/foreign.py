"""Drafts not made by draftsmith's training: a causal LM that shares the target's vocabulary
(e.g. Qwen2.5-Coder-0.5B-Instruct for the 1.5B, what llama.cpp users pair today), used off the
shelf as a draft LM, or as the starting point of a distilled one (``draft.init_from``).

Such a model carries no manifest, signature or target identity: it is loaded with a warning
naming where it came from, and accepted only when its vocabulary (token-to-id map, merges,
special tokens) is the target's, which is all a draft LM shares with its target. A chat template
may differ (the 0.5B's and the 1.5B's differ in their tool-call text): drafts see token ids only.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from draftsmith.data.identity import tokenizer_sha256
from draftsmith.data.packaged import PKG_PREFIX
from draftsmith.heads.draft_lm import DraftLMConfig
from draftsmith.heads.family import get_family

log = logging.getLogger(__name__)


def is_model_source(draft: str | Path) -> bool:
    """True for ``pkg:<key>`` or a transformers model folder that is not a draft package or an
    export (``config.json`` without ``draftsmith.json`` / ``manifest.json``)."""
    text = str(draft)
    if text.startswith(PKG_PREFIX):
        return True
    root = Path(text).expanduser()
    return (root / "config.json").is_file() and not any(
        (root / f).is_file() for f in ("draftsmith.json", "manifest.json"))


def vocabulary_problems(draft_tok: Any, target_tok: Any) -> list[str]:
    """Why two tokenizers do not map text to the same ids (empty: they do). Compared: the
    vocabulary, merges, added and special tokens, not the chat template."""
    problems = []
    if draft_tok.get_vocab() != target_tok.get_vocab():
        problems.append(f"vocabularies differ ({len(draft_tok)} and {len(target_tok)} tokens)")
    own = [(t, t.chat_template) for t in (draft_tok, target_tok)]
    try:
        for t, _ in own:
            t.chat_template = None
        if not problems and tokenizer_sha256(draft_tok) != tokenizer_sha256(target_tok):
            problems.append("merges, added or special tokens differ")
    finally:
        for t, template in own:
            t.chat_template = template
    return problems


def model_as_draft(source: str | Path, target: Any, dtype: torch.dtype = torch.float32) -> Any:
    """The causal LM at ``source`` (``pkg:<key>``, a model folder, a .gguf or a hub id) as a
    draft LM ``DraftPackage`` for the loaded ``target`` (nothing written).

    Raises:
        ValueError: its vocabulary or LM-head width is not the target's.
    """
    from draftsmith.data.target import load_target
    from draftsmith.heads.package import DraftPackage

    model = load_target(str(source), dtype=dtype)
    where = f"draft={source}"
    problems = vocabulary_problems(model.tokenizer, target.tokenizer)
    v_draft, v_target = model.model.config.vocab_size, target.model.config.vocab_size
    if v_draft != v_target:
        problems.append(f"LM heads of {v_draft} and {v_target} rows")
    if problems:
        raise ValueError(f"{where} ({model.identity.name}) cannot draft for the target "
                         f"{target.identity.name}: {'; '.join(problems)}. A draft LM must share "
                         "the target's tokenizer")
    log.warning("%s is not a draft package: %s is used off the shelf as a draft LM, unsigned "
                "and unmeasured (no manifest, signature or target record; its vocabulary was "
                "checked against the target's)", where, model.identity.name)
    cfg = model.model.config
    head = DraftLMConfig.matching(cfg, int(cfg.num_hidden_layers), init="model")
    info = {"draft_kind": "lm", "foreign": str(source), "draft_name": model.identity.name,
            "target": target.identity.to_dict()}
    return DraftPackage(family=get_family("lm"), module=model.model.eval(), head_config=head,
                        identity=target.identity, speculation=None,
                        path=model.path if model.path is not None else Path(str(source)),
                        info=info)
