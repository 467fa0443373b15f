"""Load the target model: a packaged target, a GGUF file, a local folder or a hub id.

The default target is SmolLM2-135M-Instruct. Targets shipped in pip packages are named
``pkg:<key>`` and described by ``conf/target/<key>.yaml`` (data/packaged.py: the chunk packages,
their pinned digests, the joined GGUF); a packaged target's GGUF is checked, dequantized once with
transformers into a plain fp32 safetensors folder under
``$XDG_CACHE_HOME/draftsmith/targets/<sha256[:16]>/`` (one process converts, others wait for it),
and later loads read that folder without touching the GGUF. Any local Hugging Face model
directory, GGUF file or hub id can be given as ``path`` instead. The identity recorded with
every cache, draft and export is data/identity.py's.

Every loaded tokenizer gets a chat template (:func:`apply_chat_format`): its own, or for a base
model without one the plain completion format ``PLAIN_CHAT_TEMPLATE``, so regeneration, the
feature cache and evaluation prompts format conversations the same way.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.data.cache_lock import make_once
from draftsmith.data.chat_format import apply_chat_format, check_chat_template
from draftsmith.data.gguf_read import one_parse_per_file
from draftsmith.data.identity import (
    TargetIdentity,
    TargetNotFoundError,
    sha256_file,
    state_dict_sha256,
    tokenizer_sha256,
    weights_sha256,
)
from draftsmith.data.packaged import (
    DEFAULT_PACKAGED,
    PKG_PREFIX,
    default_cache_root,
    packaged_target,
)

IDENTITY_FILE = "draftsmith_target.json"
_GGUF_MAGIC = b"GGUF"

log = logging.getLogger(__name__)


@dataclass
class LoadedTarget:
    """A loaded target: eval-mode causal LM, its tokenizer, identity and local directory.

    ``chat_format`` says which chat template the tokenizer carries (:func:`apply_chat_format`):
    ``"tokenizer"`` (its own), ``"plain"`` (``PLAIN_CHAT_TEMPLATE``) or ``"custom"``.
    """

    model: torch.nn.Module
    tokenizer: Any
    identity: TargetIdentity
    path: Path | None = None
    chat_format: str = "tokenizer"
    kernels: str = "default"  # decoding's matmul kernels (eval.decoding.kernels; set by eval)


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
        wsha = weights_sha256(local) if local is not None else state_dict_sha256(model)
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
    record = packaged_target(key)
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    out = root / record.sha256[:16]  # the pinned digest: a converted target is found unread

    def convert() -> None:
        gguf = record.gguf_file(root)  # every chunk and the whole checked before converting
        log.info("converting the target %s%s from %s to fp32 safetensors in %s (once)",
                 PKG_PREFIX, record.key, gguf, out)
        convert_gguf(gguf, out, record.name, record.sha256)

    if not (out / IDENTITY_FILE).exists():
        record.check_installed()
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
        path: None for the packaged SmolLM2-135M-Instruct GGUF; ``"pkg:<key>"`` for the target
            of ``conf/target/<key>.yaml`` (e.g. ``"pkg:gemma3_270m"``); a ``.gguf`` file (converted
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
