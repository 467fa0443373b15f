"""Which folders hold another trainer's EAGLE-3 draft (speculators, ModelOpt, SpecForge), and
the refusal to write one back as draftsmith's own. The reading is
:mod:`draftsmith.heads.peer_import`; this module imports nothing of draftsmith's, so that
loading and signing can ask it."""
from __future__ import annotations

import json
from pathlib import Path

SPECULATORS, MODELOPT, SPECFORGE = "speculators", "modelopt", "specforge"
PEER_FORMATS = (SPECULATORS, MODELOPT, SPECFORGE)
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # SGLang's (and SpecForge's) EAGLE-3 draft class


class PeerCheckpointError(ValueError):
    """A peer's checkpoint that cannot be read exactly into the EAGLE-3 head, or an attempt to
    write one back as draftsmith's own."""


def peer_config(root: Path) -> dict | None:
    """``root/config.json`` as a dict (None: missing or not JSON)."""
    try:
        return json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return None


def peer_format(path: str | Path) -> str | None:
    """``speculators``, ``modelopt`` or ``specforge`` for a peer's EAGLE-3 folder, else None.
    ModelOpt's export carries its ``eagle_config`` flags; any other ``LlamaForCausalLMEagle3``
    folder is read as SpecForge's SGLang export (SGLang's layout and layer numbering). A folder
    with draftsmith's own ``draftsmith.json`` or ``manifest.json`` is never a peer's."""
    root = Path(str(path)).expanduser()
    if not root.is_dir() or any((root / f).is_file() for f in ("draftsmith.json",
                                                                "manifest.json")):
        return None
    cfg = peer_config(root)
    if not isinstance(cfg, dict):
        return None
    if "speculators_model_type" in cfg:
        return SPECULATORS
    eagle = cfg.get("eagle_config")
    if isinstance(eagle, dict) and "use_last_layernorm" in eagle:
        return MODELOPT
    if EAGLE3_ARCHITECTURE in (cfg.get("architectures") or []):
        return SPECFORGE
    return None


def refuse_peer(path: str | Path, action: str) -> None:
    """Raise :class:`PeerCheckpointError` when ``path`` is a peer's folder: draftsmith signs,
    exports, releases and quantizes only what it wrote itself."""
    fmt = peer_format(path)
    if fmt is not None:
        raise PeerCheckpointError(
            f"{path} is a {fmt} checkpoint, an unsigned import: draftsmith does not {action} it "
            "as its own. Decode or measure it as it is (draft=FOLDER), or train a draftsmith "
            "head on the same data (make peers) and use that package")
