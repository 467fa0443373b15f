"""The draft families, each one object: everything draftsmith knows about a kind of draft.

A :class:`DraftFamily` owns its head config class, how to build the trainable module, which
tensors a package stores and how they load back, how training turns the module into per-position
pairs (``distill_targets``), its default position weights, its config checks, what it can do at
decode time (tree kind, a frequent-token draft vocabulary, assisting transformers ``generate``),
the proposer that drafts with it and the export formats it supports. Training, packages,
decoding, measuring, benchmarks and export ask the family; none of them branches on its name.

``FAMILIES`` is the one list, the four families of the house to begin with (the draft LM:
``heads/family_lm.py``, Medusa: ``family_medusa.py``, EAGLE and DFlash: ``family_fused.py``);
:func:`register` adds a family defined anywhere (a plugin, a test), :func:`unregister` takes it
out (ARCHITECTURE.md: "Adding a family").

The proposer, the batched drafter and the export writers are named by dotted paths (resolved
with ``family_base.load_object``) rather than imported: they live on the floors above
``heads/``, as serving engines keep their model registries as lazily resolved names.
"""
from __future__ import annotations

from draftsmith.heads.family_base import DraftFamily
from draftsmith.heads.family_fused import DFlashFamily, EagleFamily
from draftsmith.heads.family_lm import DraftLMFamily
from draftsmith.heads.family_medusa import MedusaFamily

__all__ = ["FAMILIES", "get_family", "register", "unregister"]


FAMILIES: dict[str, DraftFamily] = {f.name: f for f in (DraftLMFamily(), MedusaFamily(),
                                                         EagleFamily(), DFlashFamily())}


def register(family: DraftFamily) -> DraftFamily:
    """Add ``family`` to ``FAMILIES`` (``draft.kind=<its name>`` then trains, loads, decodes and
    exports it); a ValueError when the name or one of its export formats is taken."""
    if family.name in FAMILIES:
        raise ValueError(f"a draft family named {family.name!r} is registered already")
    taken = {fmt for f in FAMILIES.values() for fmt in f.export_formats}
    clash = sorted(taken & set(family.export_formats))
    if clash:
        raise ValueError(f"export formats {clash} of {family.name!r} belong to another family")
    FAMILIES[family.name] = family
    return family


def unregister(name: str) -> DraftFamily:
    """Take the family called ``name`` out of ``FAMILIES`` (a KeyError when it is not there)."""
    return FAMILIES.pop(name)


def get_family(name: str) -> DraftFamily:
    """The family called ``name``; a ValueError lists the known ones."""
    try:
        return FAMILIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown draft family {name!r}; known: {', '.join(FAMILIES)}") from None
