"""Token frequencies of a draft package, and the frequent-token draft vocabulary they give.

Drafting over only the most frequent target tokens (frequency-ranked drafting, as in FR-Spec)
cuts the draft's LM head, which for a small draft of a large-vocabulary target is most of a draft
step: 49k x 576 for SmolLM2 against two 576-wide layers. The draft's weights stay full-vocabulary
(so transformers' assisted generation can still use the same draft LM); only the decoder reads a
row subset of the LM head. Verification is unchanged, so the output distribution stays the
target's: a draft distribution ``q`` that is zero outside the subset is as valid as any other.

Training writes ``token_frequency.json`` into every package: how often each target id is a token
the draft learned to predict (loss-masked positions of the training split). ``scripts/
token_frequency.py`` adds it to a package trained before it existed.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

TOKEN_FREQUENCY = "token_frequency.json"
FULL = "full"  # decode.py's draft_vocab value for the whole vocabulary


def frequency_record(counts: Tensor, source: str) -> dict[str, Any]:
    """``token_frequency.json``: the ids seen, most frequent first, with their counts.

    Args:
        counts: ``(V,)`` count of each target id.
        source: what was counted (written into the record).
    """
    counts = torch.as_tensor(counts).flatten().long()
    seen = torch.nonzero(counts > 0).flatten()
    order = torch.sort(-counts[seen], stable=True).indices  # ties: smaller id first
    ids = seen[order]
    return {"source": source, "vocab_size": int(counts.numel()), "total": int(counts.sum()),
            "ids": ids.tolist(), "counts": counts[ids].tolist()}


def counts_from_record(record: dict[str, Any], vocab_size: int, where: str = TOKEN_FREQUENCY
                       ) -> Tensor:
    """The dense ``(vocab_size,)`` counts of a :func:`frequency_record`."""
    if int(record.get("vocab_size", -1)) != vocab_size:
        raise ValueError(f"{where} counts a vocabulary of {record.get('vocab_size')} ids, "
                         f"the target has {vocab_size}: the record belongs to another target")
    ids, counts = record.get("ids"), record.get("counts")
    if not isinstance(ids, list) or not isinstance(counts, list) or len(ids) != len(counts):
        raise ValueError(f"{where} is malformed: 'ids' and 'counts' must be lists of one length")
    dense = torch.zeros(vocab_size, dtype=torch.long)
    if ids:
        idx = torch.tensor(ids, dtype=torch.long)
        if int(idx.min()) < 0 or int(idx.max()) >= vocab_size:
            raise ValueError(f"{where} lists ids outside 0..{vocab_size - 1}")
        dense[idx] = torch.tensor(counts, dtype=torch.long)
    return dense


def package_token_counts(pkg_dir: str | Path, vocab_size: int) -> Tensor:
    """The package's token counts (its manifest was verified when it was loaded).

    Raises:
        FileNotFoundError: the package has no ``token_frequency.json``, with the fix.
    """
    path = Path(pkg_dir) / TOKEN_FREQUENCY
    if not path.is_file():
        raise FileNotFoundError(
            f"{pkg_dir} has no {TOKEN_FREQUENCY}, so a frequent-token draft vocabulary cannot be "
            f"chosen. Fix: python scripts/token_frequency.py draft={pkg_dir} (counts the package's "
            "training split), or decode with draft_vocab=full")
    return counts_from_record(json.loads(path.read_text()), vocab_size, str(path))


def frequent_ids(counts: Tensor, size: int, always_include: Sequence[int] = ()) -> Tensor:
    """The ``size`` most frequent ids (plus ``always_include``, e.g. EOS), sorted ascending."""
    return build_vocab_map(counts, int(size), always_include)[0]


def build_vocab_map(token_counts: Tensor, draft_vocab_size: int,
                    always_include: Sequence[int] = ()) -> tuple[Tensor, Tensor]:
    """Select the draft vocabulary: the most frequent target ids (plus ``always_include``).

    Ties are broken by the smaller id. The selected ids are returned sorted ascending.

    Args:
        token_counts: (V,) counts of each target id in the training data.
        draft_vocab_size: number of draft ids (<= V).
        always_include: target ids that must be in the draft vocabulary (e.g. EOS).

    Returns:
        ``d2t`` (V_draft,) long, the target id of each draft id, and ``t2d`` (V,) bool.
    """
    counts = torch.as_tensor(token_counts).flatten().to(torch.float64)
    vocab = counts.numel()
    if not 1 <= draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab} (the target vocabulary), "
                         f"got {draft_vocab_size}")
    forced = sorted({int(i) for i in always_include})
    if any(not 0 <= i < vocab for i in forced):
        raise ValueError(f"always_include ids must be in 0..{vocab - 1}, got {forced}")
    if len(forced) > draft_vocab_size:
        raise ValueError(f"always_include has {len(forced)} ids, more than draft_vocab_size "
                         f"{draft_vocab_size}")
    score = counts.clone()
    score[forced] = float("inf")
    # Stable sort on descending counts keeps smaller ids first among ties.
    order = torch.sort(-score, stable=True).indices
    d2t = torch.sort(order[:draft_vocab_size]).values.long()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[d2t] = True
    return d2t, t2d


def cut_draft_vocab(state: dict[str, Tensor], counts: Tensor, size: int,
                    always_include: Sequence[int] = ()) -> dict[str, Tensor]:
    """A reduced-vocabulary head's stored tensors cut to its ``size`` most frequent draft ids.

    The kept rows are the head's own ids ranked by ``counts`` (ties: the smaller target id), plus
    ``always_include`` where the head has them (e.g. EOS), in the head's order; ``d2t``, ``t2d``
    and the LM head's rows follow: the head drafts over that subset as the full head does over a
    decode-time subset (``eval/decode.py draft_vocab=N``, the same counts), with an LM head
    ``size`` rows tall.

    Raises:
        ValueError: the state is not a reduced-vocabulary head's, or ``size`` is not below its
            draft vocabulary.
    """
    if "d2t" not in state or "lm_head.weight" not in state:
        raise ValueError("draft_vocab applies to reduced-vocabulary EAGLE heads (d2t / t2d maps "
                         "and their own LM head); this package has none: omit draft_vocab")
    d2t = state["d2t"].long()
    if not 0 < size < d2t.numel():
        raise ValueError(f"draft_vocab={size}: the head drafts over {d2t.numel()} ids; choose a "
                         f"smaller positive number, or omit draft_vocab to keep them all")
    score = torch.as_tensor(counts).flatten().to(torch.float64)[d2t]
    forced = torch.isin(d2t, torch.as_tensor(list(always_include), dtype=torch.long))
    score = torch.where(forced, torch.inf, score)
    order = sorted(range(d2t.numel()), key=lambda i: (-float(score[i]), int(d2t[i])))
    rows = torch.tensor(sorted(order[:size]), dtype=torch.long)
    t2d = torch.zeros_like(state["t2d"], dtype=torch.bool)
    t2d[d2t[rows]] = True
    return {**state, "d2t": d2t[rows].to(state["d2t"].dtype), "t2d": t2d,
            "lm_head.weight": state["lm_head.weight"][rows]}
