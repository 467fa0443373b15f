"""What makes two targets interchangeable: the target identity and the hashes it is made of.

A feature cache, a draft package and an export each record the :class:`TargetIdentity` they were
made for; loading one against another target is refused field by field
(:meth:`TargetIdentity.check_compatible`). :func:`sha256_file` is the one file hash used across
draftsmith (manifests, packaged targets, identities).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


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
                + "; ".join(diffs)
                + ". Fix: load the target it was made for, or rebuild it for this target."
            )


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
    added = sorted(
        (i, t.content, bool(t.special))
        for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
    )
    h.update(json.dumps(added, ensure_ascii=False).encode())
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    h.update(json.dumps(special, ensure_ascii=False, sort_keys=True).encode())
    h.update(json.dumps(tokenizer.chat_template or "", ensure_ascii=False).encode())
    return h.hexdigest()


def weights_sha256(model_dir: Path) -> str:
    """sha256 over the weight files of a model directory (file names and contents, sorted)."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not files:
        raise TargetNotFoundError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {model_dir}")
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + sha256_file(p).encode())
    return h.hexdigest()


def state_dict_sha256(model: torch.nn.Module) -> str:
    """sha256 over a model's parameters and buffers (names, dtypes, bytes): the identity of a
    model loaded from a hub id, whose files are not at hand."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode() + b"\0" + str(v.dtype).encode())
        h.update(v.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
