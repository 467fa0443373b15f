"""The draft package: the folder training writes, the decoder reads and export converts.

Layout of a package folder::

    draftsmith.json        draft_kind (lm | medusa | eagle), head_config, target identity,
                           format_version, target_config (the target's model config)
    model.safetensors      the draft's trainable weights (for ``lm`` a full HF model dir:
                           config.json, generation_config.json, model.safetensors, tokenizer files)
    training_config.yaml   optional: the resolved training config
    validation.json        optional: training-time estimates (a_hat per position, ...)
    speculation.json       optional: measured decoding numbers (K*, alpha_i, ...)
    manifest.json          sha256 and size of every other file + draft family, target identity,
                           format_version, the training config and the signer (heads/manifest.py)
    model.sig              the model-signing signature over every file (heads/signing.py)

A package is written to ``<out>.tmp-<pid>`` and moved into place with ``os.replace``, so a run
killed mid-write leaves either the previous package or none at ``<out>``, never a half one.
``load_package`` refuses a package that is unsigned or signed by an untrusted key, whose files do
not match the manifest (or are unlisted, links, outside it), and a draft trained for another
target or tokenizer. Optional files (``speculation.json``) are read only when listed.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from draftsmith.data.identity import TargetIdentity, TargetMismatchError, sha256_file
from draftsmith.heads.family import FAMILIES, get_family
from draftsmith.heads.family_base import DraftFamily, HeadStateError
from draftsmith.heads.manifest import (
    CARD,
    MANIFEST,
    SIGNATURE,
    PackageIntegrityError,
    listed,
    verify_manifest,
    write_json_atomic,
    write_manifest,
)
from draftsmith.heads.publish import staged
from draftsmith.heads.signing import (
    PackageSignatureError,
    sign_folder,
    unsigned_allowed,
    verify_folder_signature,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
PACKAGE_JSON = "draftsmith.json"
TRAINING_CONFIG = "training_config.yaml"
SPECULATION = "speculation.json"


@dataclass
class DraftPackage:
    """A loaded draft package.

    Attributes:
        family: the draft's family (``heads.family.FAMILIES``; ``draft_kind`` in its files).
        module: the draft ``nn.Module`` (eval mode).
        head_config: the family's config dataclass.
        identity: the ``TargetIdentity`` the draft was trained for.
        speculation: contents of ``speculation.json`` or None.
        path: the package folder.
        info: contents of ``draftsmith.json``.
    """

    family: DraftFamily
    module: nn.Module
    head_config: Any
    identity: Any
    speculation: dict | None
    path: Path
    info: dict = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------- verify / write
def verify_package(root: str | Path, allow_unverified: bool = False, allow_unsigned: bool = False,
                   trusted_keys: Any = None) -> tuple[dict[str, Any], str | None]:
    """Check ``root``'s signature, then its manifest over every file.

    Returns:
        (the manifest, the trusted signer's fingerprint or None when the signature check was
        overridden by ``allow_unsigned`` / ``DRAFTSMITH_ALLOW_UNSIGNED`` / ``allow_unverified``).

    Raises:
        PackageIntegrityError: a file differs from the manifest, is unlisted, a link, or the
            manifest is malformed (reported before a signature problem: it names the file).
        PackageSignatureError: unsigned, signed by an untrusted key, or the signature does not
            match (e.g. a manifest rewritten to match changed files).
    """
    root = Path(root)
    try:
        signer, sig_error = verify_folder_signature(root, trusted_keys), None
    except PackageSignatureError as e:
        signer, sig_error = None, e
    manifest = verify_manifest(root, allow_unverified)
    if sig_error is not None:
        if not (allow_unverified or unsigned_allowed(allow_unsigned)):
            raise sig_error
        log.warning("!" * 78 + "\nLOADING AN UNSIGNED OR UNTRUSTED DRAFT PACKAGE %s (allow_unsigned"
                    "=True or DRAFTSMITH_ALLOW_UNSIGNED=1):\n  - %s\n" + "!" * 78, root,
                    "\n  - ".join(sig_error.problems))
    return manifest, signer


def verify_folder(root: str | Path, allow_unverified: bool = False, allow_unsigned: bool = False,
                  trusted_keys: Any = None) -> dict[str, Any]:
    """:func:`verify_package`'s manifest (signature and every file checked)."""
    return verify_package(root, allow_unverified, allow_unsigned, trusted_keys)[0]


# ----------------------------------------------------------------------------- config helpers
def _to_dict(obj: Any) -> dict:
    if obj is None:
        return {}
    if isinstance(obj, dict):
        return dict(obj)
    if hasattr(obj, "to_dict"):
        return dict(obj.to_dict())
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    raise TypeError(f"cannot turn {type(obj).__name__} into a dict: give a dict, a dataclass or "
                    "an object with to_dict()")


def _plain_config(train_config: Any) -> dict | None:
    if train_config is None:
        return None
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(train_config, DictConfig):
            return OmegaConf.to_container(train_config, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover
        pass
    return _to_dict(train_config)


def _identity_dict(identity: Any) -> dict:
    return TargetIdentity.from_dict(_to_dict(identity)).to_dict()


# ----------------------------------------------------------------------------- save
def save_package(out_dir: str | Path, kind: str, module: nn.Module, head_config: Any,
                 identity: Any, tokenizer: Any = None, extra_json: dict[str, dict] | None = None,
                 train_config: Any = None, target_config: Any = None) -> Path:
    """Write a draft package atomically.

    Args:
        out_dir: the package folder to create (replaced if it exists).
        kind: the draft family's name (``heads.family.FAMILIES``).
        module: the draft (for ``lm`` a transformers causal LM).
        head_config: the family's config dataclass (or dict).
        identity: ``TargetIdentity`` (or its dict) of the target the draft was trained for.
        tokenizer: for ``lm``, the tokenizer saved beside the model (None: no tokenizer files).
        extra_json: ``{"speculation.json": {...}, "validation": {...}}``; ``.json`` is added
            when missing.
        train_config: the resolved training config (dict or DictConfig) or None.
        target_config: the target's model config (``PretrainedConfig`` or dict); lets heads be
            rebuilt without loading the target. None: the one the module holds, if any (an
            EAGLE head's decoder-layer config).

    Returns:
        The package folder.
    """
    family = get_family(kind)
    out = Path(out_dir)
    ident = _identity_dict(identity)
    train_cfg = _plain_config(train_config)
    with staged(out) as tmp:
        family.save(module, head_config, tmp, tokenizer)
        if target_config is None:
            target_config = family.target_config_of(module)
        tcfg = _to_dict(target_config) if target_config is not None else None
        if tcfg is not None:  # a head's own config is cut to one layer: record the target's
            tcfg["num_hidden_layers"] = ident["num_layers"]
            tcfg.pop("layer_types", None)
        info = {"draft_kind": kind, "format_version": FORMAT_VERSION,
                "head_config": _to_dict(head_config), "target": ident, "target_config": tcfg,
                "draft_config": family.draft_config_of(module)}
        write_json_atomic(tmp / PACKAGE_JSON, info)
        if train_cfg is not None:
            from omegaconf import OmegaConf
            (tmp / TRAINING_CONFIG).write_text(OmegaConf.to_yaml(OmegaConf.create(train_cfg)))
        for name, obj in (extra_json or {}).items():
            write_json_atomic(tmp / _json_name(name), obj)
        write_manifest(tmp, _manifest_meta(info, train_cfg))
        sign_folder(tmp)
    return out


def derive_package(src: Path, dst: Path, leave_out: tuple[str, ...] = (),
                   write: Any = None) -> Path:
    """Write ``dst``, a signed copy of the package ``src`` with changes: every file but the
    manifest, the signature and ``leave_out`` copied, then ``write(tmp)`` adds or replaces
    files, then a new manifest (the old one's metadata kept) and signature (the local key).
    A model card (``README.md``, unsigned) describes its own folder: ``src``'s is not copied,
    and ``dst``'s, when ``dst`` exists, is kept (with a warning to update its figures).
    Atomic, like :func:`save_package`; returns ``dst``."""
    with staged(dst) as tmp:
        for f in sorted(p for p in src.rglob("*") if p.is_file()):
            rel = f.relative_to(src).as_posix()
            if rel in (MANIFEST, SIGNATURE, CARD, *leave_out):
                continue
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, tmp / rel)
        if (dst / CARD).is_file() and not (dst / CARD).is_symlink():
            shutil.copy2(dst / CARD, tmp / CARD)
            log.warning("%s: its model card %s is kept; update it for the new files", dst, CARD)
        if write is not None:
            write(tmp)
        old = json.loads((src / MANIFEST).read_text())
        write_manifest(tmp, {k: v for k, v in old.items() if k not in ("files", "signer")})
        sign_folder(tmp)
    return dst


def _json_name(name: str) -> str:
    if "/" in name or "\\" in name or name.startswith(".") or name in (MANIFEST, PACKAGE_JSON):
        raise ValueError(f"extra_json name {name!r} is reserved or not a plain file name")
    return name if name.endswith(".json") else f"{name}.json"


def _manifest_meta(info: dict, train_cfg: dict | None) -> dict:
    return {"format_version": info["format_version"], "draft_kind": info["draft_kind"],
            "target": info["target"], "training_config": train_cfg}


def update_package_json(pkg_dir: str | Path, name: str, obj: dict, allow_unsigned: bool = False,
                        trusted_keys: Any = None) -> Path:
    """Rewrite one JSON file of a package or export (e.g. ``speculation.json``), its manifest
    entry and signature (re-signed with the local key).

    The folder is verified first (signature and every file), so a tampered package is refused
    rather than re-signed. One whose signature check is overridden (``allow_unsigned`` or
    ``DRAFTSMITH_ALLOW_UNSIGNED=1``) is updated but left unsigned.
    """
    root = Path(pkg_dir)
    manifest, signer = verify_package(root, allow_unsigned=allow_unsigned,
                                      trusted_keys=trusted_keys)
    rel = _json_name(name)
    write_json_atomic(root / rel, obj)
    manifest["files"][rel] = {"sha256": sha256_file(root / rel),
                              "size": (root / rel).stat().st_size}
    manifest.pop("signer", None)
    write_json_atomic(root / MANIFEST, manifest)
    if signer is not None:
        sign_folder(root)
    else:
        (root / SIGNATURE).unlink(missing_ok=True)
        log.warning("%s updated but left unsigned (its signature check was overridden)", root)
    return root / rel


# ----------------------------------------------------------------------------- load
def check_target(saved: dict, actual: Any, where: str = "draft package") -> None:
    """Raise ``TargetMismatchError`` naming every differing identity field and both values."""
    TargetIdentity.from_dict(saved).check_compatible(
        TargetIdentity.from_dict(_to_dict(actual)), where=where)


def load_package(pkg_dir: str | Path, target: Any = None, allow_unverified: bool = False,
                 allow_unsigned: bool = False, trusted_keys: Any = None) -> DraftPackage:
    """Load and verify a draft package.

    Args:
        pkg_dir: the package folder.
        target: a ``LoadedTarget`` (``model``, ``identity``); when given, its identity must match
            the package's and frozen parts (EAGLE embedding / LM head) are attached from it.
        allow_unverified: load despite integrity, signature or identity problems (logs a loud
            warning).
        allow_unsigned: load an unsigned package, or one signed by an untrusted key (logs a loud
            warning; also ``DRAFTSMITH_ALLOW_UNSIGNED=1``); the manifest is still checked.
        trusted_keys: PEM public keys (files or folders) trusted beside the default ones
            (``heads.keys``).

    The trusted signer's fingerprint is ``info["signer"]`` (None when the check was overridden).

    Raises:
        PackageSignatureError: unsigned, signed by an untrusted key, or the signature does not
            match the files (a manifest rewritten to match tampered files).
        PackageIntegrityError: a file is modified, truncated, missing, unlisted or a link, or the
            manifest is malformed or names a path outside the package.
        TargetMismatchError: the draft was trained for another target or tokenizer.
    """
    root = Path(pkg_dir)
    if not (root / PACKAGE_JSON).is_file():
        from draftsmith.heads.peer_format import refuse_peer

        refuse_peer(root, "load as a package (to export, release, quantize or train on)")
        hint = ""
        if list(root.parent.glob(f"{root.name}.old-*")):
            hint = " (a previous save was interrupted; the old package is beside it as .old-<pid>)"
        raise PackageIntegrityError(root,
                                    [f"'{PACKAGE_JSON}' is missing: not a draft package{hint}"])
    manifest, signer = verify_package(root, allow_unverified, allow_unsigned, trusted_keys)
    info = {**json.loads((root / PACKAGE_JSON).read_text()), "signer": signer}
    _check_info(root, info, manifest, allow_unverified)
    if target is not None:
        try:
            check_target(info["target"], target.identity)
        except TargetMismatchError as e:
            if not allow_unverified:
                raise
            log.warning("!" * 78 + "\nLOADING A DRAFT FOR ANOTHER TARGET (allow_unverified=True): "
                        "%s\n" + "!" * 78, e)
    kind = info["draft_kind"]
    family = get_family(kind)
    cfg = family.config_class.from_dict(info["head_config"])
    module = load_module(family, root, cfg, info, target)
    quant = info.get("quantization")
    if quant:  # an int8 copy (scripts/quantize.py): the int8 weights are made from the stored ones
        from draftsmith.heads.quantize import quantize
        from draftsmith.heads.weights import stored_int8
        try:  # (or are stored as int8 already: a release of an int8 copy)
            quantize(module, quant.get("scheme"), list(quant.get("modules") or []),
                     stored_int8(root) if not family.hf_model else None)
        except ValueError as e:
            raise PackageIntegrityError(root, [f"{PACKAGE_JSON} quantization: {e}"]) from e
    module.eval()
    listed_spec = listed(manifest, SPECULATION) and (root / SPECULATION).is_file()
    speculation = json.loads((root / SPECULATION).read_text()) if listed_spec else None
    return DraftPackage(family=family, module=module, head_config=cfg,
                        identity=TargetIdentity.from_dict(info["target"]), speculation=speculation,
                        path=root, info=info)


def _check_info(root: Path, info: dict, manifest: dict, allow_unverified: bool) -> None:
    problems = []
    if info.get("draft_kind") not in FAMILIES:
        problems.append(f"draft_kind {info.get('draft_kind')!r} in {PACKAGE_JSON} is not one of "
                        f"{tuple(FAMILIES)}")
    version = info.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        problems.append(f"format_version {version!r} in {PACKAGE_JSON} is not supported by this "
                        f"draftsmith (reads up to {FORMAT_VERSION}); upgrade draftsmith")
    for key in ("draft_kind", "target", "format_version"):
        if manifest and manifest.get(key) != info.get(key):
            problems.append(f"{key} differs between {MANIFEST} ({manifest.get(key)!r}) and "
                            f"{PACKAGE_JSON} ({info.get(key)!r})")
    if problems and not allow_unverified:
        raise PackageIntegrityError(root, problems)


def target_config(info: dict, target: Any) -> Any:
    """The target's model config: the given target's, else the stored one, else None."""
    if target is not None:
        return target.model.config
    from transformers import AutoConfig, LlamaConfig
    d = info.get("target_config")
    if not d:
        return None
    d = dict(d)
    model_type = d.pop("model_type", "llama")
    return AutoConfig.for_model(model_type, **d) if model_type != "llama" else LlamaConfig(**d)


def load_module(family: DraftFamily, folder: Path, cfg: Any, info: dict,
                target: Any = None) -> nn.Module:
    """The draft module stored in ``folder`` (a package or an export of the family's layout).

    Without a target, heads are built from the stored ``target_config``; an EAGLE head's frozen
    parts then stay unset until ``head.attach_target(model)``.
    """
    tcfg = target_config(info, target)
    try:
        return family.load(folder, cfg, info["target"], tcfg,
                           None if target is None else target.model)
    except HeadStateError as e:
        raise PackageIntegrityError(folder, [str(e)]) from e
