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

import copy
import dataclasses
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from data.target import TargetMismatchError, sha256_file

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
PACKAGE_JSON = "draftsmith.json"
MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
TRAINING_CONFIG = "training_config.yaml"
DRAFT_KINDS = ("lm", "medusa", "eagle")
# Files with these endings hold weights: an unlisted one is refused (it could shadow the real one).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".npz", ".h5")
# Identity fields of a target; all but ``name`` must match between a package and its target.
IDENTITY_FIELDS = ("name", "weights_sha256", "tokenizer_sha256", "vocab_size", "hidden_size",
                   "num_layers")
COMPARED_FIELDS = IDENTITY_FIELDS[1:]


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
        kind: draft family, one of ``DRAFT_KINDS``.
        module: the draft ``nn.Module`` (eval mode).
        head_config: the family's config dataclass.
        identity: the target identity the draft was trained for (``TargetIdentity`` or dict).
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
    d = _to_dict(identity)
    missing = [k for k in IDENTITY_FIELDS if k not in d]
    if missing:
        raise ValueError(f"target identity lacks fields {missing}; expected {list(IDENTITY_FIELDS)}")
    return d


def head_config_class(kind: str) -> type:
    """The config dataclass of a draft family."""
    if kind == "lm":
        from heads.draft_lm import DraftLMConfig
        return DraftLMConfig
    if kind == "medusa":
        from heads.medusa import MedusaConfig
        return MedusaConfig
    if kind == "eagle":
        from heads.eagle import EagleConfig
        return EagleConfig
    raise ValueError(f"unknown draft kind {kind!r}; expected one of {DRAFT_KINDS}")


def saved_state_dict(kind: str, module: nn.Module, head_config: Any) -> dict[str, torch.Tensor]:
    """The tensors a package stores for a head: frozen parts copied from the target are left out.

    EAGLE leaves out ``embed_tokens.*`` always and ``lm_head.*`` when it uses the target's LM head
    (``draft_vocab_size`` is None); they are re-attached from the target on load.
    """
    state = module.state_dict()
    if kind == "eagle":
        cfg = _to_dict(head_config)
        drop = ("embed_tokens.",) + (("lm_head.",) if cfg.get("draft_vocab_size") is None else ())
        state = {k: v for k, v in state.items() if not k.startswith(drop)}
    # safetensors refuses shared or non-contiguous storage: store independent copies
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}


# ----------------------------------------------------------------------------- save
def save_package(out_dir: str | Path, kind: str, module: nn.Module, head_config: Any,
                 identity: Any, tokenizer: Any = None, extra_json: dict[str, dict] | None = None,
                 train_config: Any = None, target_config: Any = None) -> Path:
    """Write a draft package atomically.

    Args:
        out_dir: the package folder to create (replaced if it exists).
        kind: ``lm`` | ``medusa`` | ``eagle``.
        module: the draft (for ``lm`` a transformers causal LM).
        head_config: the family's config dataclass (or dict).
        identity: ``TargetIdentity`` (or its dict) of the target the draft was trained for.
        tokenizer: for ``lm``, the tokenizer saved beside the model (None: no tokenizer files).
        extra_json: ``{"speculation.json": {...}, "validation": {...}}``; ``.json`` is added
            when missing.
        train_config: the resolved training config (dict or DictConfig) or None.
        target_config: the target's model config (``PretrainedConfig`` or dict); lets heads be
            rebuilt without loading the target. None: taken from the first transformers
            config found inside an EAGLE head (its decoder layer's), else not stored.

    Returns:
        The package folder.
    """
    if kind not in DRAFT_KINDS:
        raise ValueError(f"unknown draft kind {kind!r}; expected one of {DRAFT_KINDS}")
    out = Path(out_dir)
    ident = _identity_dict(identity)
    train_cfg = _plain_config(train_config)
    tmp = fresh_tmp_dir(out)
    try:
        if kind == "lm":
            if hasattr(module, "merge_and_unload"):  # a LoRA-wrapped draft: store merged weights
                module = copy.deepcopy(module).merge_and_unload()
            module.save_pretrained(tmp, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        else:
            save_file(saved_state_dict(kind, module, head_config), str(tmp / WEIGHTS),
                      metadata={"format": "pt", "draft_kind": kind})
        if target_config is None and kind == "eagle":
            target_config = _config_inside(module)
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


def _config_inside(module: nn.Module) -> Any:
    from transformers import PretrainedConfig
    for sub in module.modules():
        cfg = getattr(sub, "config", None)
        if isinstance(cfg, PretrainedConfig):
            return cfg
    return None


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
    have = _identity_dict(actual)
    diffs = [f"{k}: {where} was trained for {saved.get(k)!r}, the given target has {have.get(k)!r}"
             for k in COMPARED_FIELDS if saved.get(k) != have.get(k)]
    if diffs:
        raise TargetMismatchError(
            f"{where} does not match the target ({'; '.join(diffs)}). Fix: load the target it was "
            "trained for, or retrain the draft on this target.")


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
        raise PackageIntegrityError(root, [f"'{PACKAGE_JSON}' is missing: not a draft package{hint}"])
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
    cfg = head_config_class(kind).from_dict(info["head_config"])
    if kind == "lm":
        from transformers import AutoModelForCausalLM
        module = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32)
    else:
        module = build_head(kind, cfg, info, target)
        load_head_state(kind, module, cfg, load_file(str(root / WEIGHTS)), str(root / WEIGHTS))
    module.eval()
    spec_path = root / "speculation.json"
    speculation = json.loads(spec_path.read_text()) if spec_path.is_file() else None
    return DraftPackage(kind=kind, module=module, head_config=cfg,
                        identity=_identity_obj(info["target"]), speculation=speculation,
                        path=root, info=info)


def _check_info(root: Path, info: dict, manifest: dict, allow_unverified: bool) -> None:
    problems = []
    if info.get("draft_kind") not in DRAFT_KINDS:
        problems.append(f"draft_kind {info.get('draft_kind')!r} in {PACKAGE_JSON} is not one of "
                        f"{DRAFT_KINDS}")
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


def _identity_obj(d: dict) -> Any:
    try:
        from data.target import TargetIdentity
        return TargetIdentity.from_dict(d)
    except ImportError:  # pragma: no cover
        return dict(d)


def _target_config(info: dict, target: Any) -> Any:
    if target is not None:
        return target.model.config
    from transformers import AutoConfig, LlamaConfig
    d = info.get("target_config")
    if not d:
        raise ValueError("this package stores no target_config: pass target=... to load it")
    d = dict(d)
    model_type = d.pop("model_type", "llama")
    return AutoConfig.for_model(model_type, **d) if model_type != "llama" else LlamaConfig(**d)


def build_head(kind: str, cfg: Any, info: dict, target: Any = None) -> nn.Module:
    """An untrained head of the package's family and shapes (frozen parts from ``target``).

    Without a target an EAGLE head is built from the stored ``target_config``; its frozen parts
    (embedding, full-vocabulary LM head) stay unset until ``head.attach_target(model)``.
    """
    ident = info["target"]
    if kind == "medusa":
        from heads.medusa import MedusaHeads
        return MedusaHeads(cfg, ident["hidden_size"], ident["vocab_size"])
    if kind == "eagle":
        from heads.eagle import EagleHead
        head = EagleHead(cfg, _target_config(info, target))
        if target is not None:
            head.attach_target(target.model)
        else:
            log.warning("EAGLE package loaded without its target: embedding and target LM head "
                        "are unset; call module.attach_target(target_model) before decoding")
        return head
    raise ValueError(f"build_head handles medusa and eagle, not {kind!r}")


def load_head_state(kind: str, module: nn.Module, cfg: Any, state: dict[str, torch.Tensor],
                    source: str) -> None:
    """Load stored tensors into a head; the only keys allowed to be absent are frozen parts."""
    expected = set(saved_state_dict(kind, module, cfg))
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - set(module.state_dict()))
    if missing or unexpected:
        problem = (f"weights do not fit a {kind} head with config {_to_dict(cfg)}: missing "
                   f"{missing[:8]}, unexpected {unexpected[:8]}")
        raise PackageIntegrityError(source, [problem])
    own = module.state_dict()
    bad = [f"{k}: stored {tuple(v.shape)}, head expects {tuple(own[k].shape)}"
           for k, v in state.items() if tuple(v.shape) != tuple(own[k].shape)]
    if bad:
        raise PackageIntegrityError(source, [f"tensor shapes do not fit the head: {bad[:8]}"])
    module.load_state_dict(state, strict=False)
