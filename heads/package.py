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
                           format_version and the training config

A package is written to ``<out>.tmp-<pid>`` and moved into place with ``os.replace``, so a run
killed mid-write leaves either the previous package or none at ``<out>``, never a half one.
``load_package`` refuses a package whose files do not match the manifest, and a draft trained for
another target or tokenizer.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from data.target import TargetIdentity, TargetMismatchError, sha256_file
from heads.family import FAMILIES, DraftFamily, HeadStateError, get_family

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
PACKAGE_JSON = "draftsmith.json"
MANIFEST = "manifest.json"
TRAINING_CONFIG = "training_config.yaml"
# Files with these endings hold weights: an unlisted one is refused (it could shadow the real one).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".npz", ".h5")


class PackageIntegrityError(RuntimeError):
    """A package's files do not match its manifest (modified, truncated, missing or extra)."""

    def __init__(self, path: Path | str, problems: list[str]):
        self.path = Path(path)
        self.problems = list(problems)
        lines = "\n  - ".join(self.problems)
        super().__init__(
            f"draft package {self.path} failed its integrity check:\n  - {lines}\n"
            "Fix: re-export or re-download the package; to load it anyway (unsafe) pass "
            "allow_unverified=True.")


@dataclass
class DraftPackage:
    """A loaded draft package.

    Attributes:
        kind: the draft family's name (``heads.family.FAMILIES``).
        module: the draft ``nn.Module`` (eval mode).
        head_config: the family's config dataclass.
        identity: the ``TargetIdentity`` the draft was trained for.
        speculation: contents of ``speculation.json`` or None.
        path: the package folder.
        info: contents of ``draftsmith.json``.
    """

    kind: str
    module: nn.Module
    head_config: Any
    identity: Any
    speculation: dict | None
    path: Path
    info: dict = dataclasses.field(default_factory=dict)

    @property
    def family(self) -> DraftFamily:
        return get_family(self.kind)


# ----------------------------------------------------------------------------- hashing / manifest


def _listed_files(root: Path) -> list[str]:
    """Every regular file under ``root`` except the manifest, as sorted POSIX relative paths."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def write_manifest(root: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Hash every file in ``root`` and write ``manifest.json`` (atomically).

    Args:
        root: a package or export folder.
        meta: extra fields recorded beside ``files`` (draft family, target identity, ...).

    Returns:
        The manifest dict.
    """
    files = {rel: {"sha256": sha256_file(root / rel), "size": (root / rel).stat().st_size}
             for rel in _listed_files(root)}
    manifest = {**meta, "files": files}
    _write_json_atomic(root / MANIFEST, manifest)
    return manifest


def read_manifest(root: Path) -> dict[str, Any]:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise PackageIntegrityError(root, [f"'{MANIFEST}' is missing, so no file can be verified"])
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PackageIntegrityError(root, [f"'{MANIFEST}' is not valid JSON ({e})"]) from e


def manifest_problems(root: Path, manifest: dict[str, Any]) -> list[str]:
    """Compare the files in ``root`` with the manifest; one message per problem (empty = intact)."""
    problems = []
    listed = manifest.get("files", {})
    for rel, entry in sorted(listed.items()):
        path = root / rel
        if not path.is_file():
            problems.append(f"file '{rel}' is listed in {MANIFEST} but missing")
            continue
        size = path.stat().st_size
        if size != entry["size"]:
            how = "truncated" if size < entry["size"] else "longer than recorded"
            problems.append(f"file '{rel}' is {how}: {size} bytes on disk, {entry['size']} bytes "
                            f"in {MANIFEST}")
            continue
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            problems.append(f"file '{rel}' was modified: sha256 {digest[:16]}... on disk, "
                            f"{entry['sha256'][:16]}... in {MANIFEST}")
    for rel in _listed_files(root):
        if rel not in listed and rel.endswith(WEIGHT_SUFFIXES):
            problems.append(f"weight file '{rel}' is not listed in {MANIFEST} (unlisted extra "
                            "weights are refused)")
    return problems


def verify_folder(root: Path, allow_unverified: bool = False) -> dict[str, Any]:
    """Verify ``root`` against its manifest; raise ``PackageIntegrityError`` or warn loudly.

    Returns:
        The manifest (an empty dict when it is missing and ``allow_unverified`` is set).
    """
    try:
        manifest = read_manifest(root)
        problems = manifest_problems(root, manifest)
    except PackageIntegrityError as e:
        if not allow_unverified:
            raise
        manifest, problems = {}, e.problems
    if problems:
        if not allow_unverified:
            raise PackageIntegrityError(root, problems)
        log.warning("!" * 78 + "\nLOADING AN UNVERIFIED DRAFT PACKAGE %s (allow_unverified=True):"
                    "\n  - %s\n" + "!" * 78, root, "\n  - ".join(problems))
    return manifest


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def publish_dir(tmp: Path, out: Path) -> None:
    """Move a complete folder ``tmp`` to ``out``, replacing an older ``out`` without a half state.

    ``os.replace`` cannot replace a non-empty folder, so an old ``out`` is first renamed aside;
    a kill between the two renames leaves no package at ``out`` (and the old one beside it as
    ``<out>.old-<pid>``), never a mixed one.
    """
    _fsync_tree(tmp)
    old = out.with_name(f"{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    if old.exists():
        shutil.rmtree(old)


def fresh_tmp_dir(out: Path) -> Path:
    """An empty ``<out>.tmp-<pid>`` folder next to ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


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
    tmp = fresh_tmp_dir(out)
    try:
        family.save(module, head_config, tmp, tokenizer)
        if target_config is None:
            target_config = family.target_config_of(module)
        tcfg = _to_dict(target_config) if target_config is not None else None
        if tcfg is not None:  # a head's own config is cut to one layer: record the target's
            tcfg["num_hidden_layers"] = ident["num_layers"]
            tcfg.pop("layer_types", None)
        info = {"draft_kind": kind, "format_version": FORMAT_VERSION,
                "head_config": _to_dict(head_config), "target": ident, "target_config": tcfg}
        _write_json_atomic(tmp / PACKAGE_JSON, info)
        if train_cfg is not None:
            from omegaconf import OmegaConf
            (tmp / TRAINING_CONFIG).write_text(OmegaConf.to_yaml(OmegaConf.create(train_cfg)))
        for name, obj in (extra_json or {}).items():
            _write_json_atomic(tmp / _json_name(name), obj)
        write_manifest(tmp, _manifest_meta(info, train_cfg))
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _json_name(name: str) -> str:
    if "/" in name or name in (MANIFEST, PACKAGE_JSON):
        raise ValueError(f"extra_json name {name!r} is reserved or not a plain file name")
    return name if name.endswith(".json") else f"{name}.json"


def _manifest_meta(info: dict, train_cfg: dict | None) -> dict:
    return {"format_version": info["format_version"], "draft_kind": info["draft_kind"],
            "target": info["target"], "training_config": train_cfg}


def update_package_json(pkg_dir: str | Path, name: str, obj: dict) -> Path:
    """Rewrite one JSON file of a package (e.g. ``speculation.json``) and its manifest entry.

    The other files keep their recorded hashes, so a file tampered with before the update is
    still detected afterwards.
    """
    root = Path(pkg_dir)
    manifest = read_manifest(root)
    rel = _json_name(name)
    _write_json_atomic(root / rel, obj)
    manifest.setdefault("files", {})[rel] = {"sha256": sha256_file(root / rel),
                                             "size": (root / rel).stat().st_size}
    _write_json_atomic(root / MANIFEST, manifest)
    return root / rel


# ----------------------------------------------------------------------------- load
def check_target(saved: dict, actual: Any, where: str = "draft package") -> None:
    """Raise ``TargetMismatchError`` naming every differing identity field and both values."""
    TargetIdentity.from_dict(saved).check_compatible(
        TargetIdentity.from_dict(_to_dict(actual)), where=where)


def load_package(pkg_dir: str | Path, target: Any = None,
                 allow_unverified: bool = False) -> DraftPackage:
    """Load and verify a draft package.

    Args:
        pkg_dir: the package folder.
        target: a ``LoadedTarget`` (``model``, ``identity``); when given, its identity must match
            the package's and frozen parts (EAGLE embedding / LM head) are attached from it.
        allow_unverified: load despite integrity or identity problems (logs a loud warning).

    Raises:
        PackageIntegrityError: a file is modified, truncated, missing or unlisted.
        TargetMismatchError: the draft was trained for another target or tokenizer.
    """
    root = Path(pkg_dir)
    if not (root / PACKAGE_JSON).is_file():
        hint = ""
        if list(root.parent.glob(f"{root.name}.old-*")):
            hint = " (a previous save was interrupted; the old package is beside it as .old-<pid>)"
        raise PackageIntegrityError(root,
                                    [f"'{PACKAGE_JSON}' is missing: not a draft package{hint}"])
    manifest = verify_folder(root, allow_unverified)
    info = json.loads((root / PACKAGE_JSON).read_text())
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
    module.eval()
    spec_path = root / "speculation.json"
    speculation = json.loads(spec_path.read_text()) if spec_path.is_file() else None
    return DraftPackage(kind=kind, module=module, head_config=cfg,
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
