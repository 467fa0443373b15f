"""Export a draft package for serving engines.

    python scripts/export.py draft=outputs/eagle/package format=eagle out=exports/eagle

Formats (layouts and their sources: ``scripts/export_layouts.py``; file names and the draft
family of each format: ``heads/exports.py``):

* ``hf``          draft LM -> transformers model dir (``assistant_model`` in ``generate``).
* ``gguf``        llama.cpp GGUF (``draft.gguf``): a draft LM written directly
                  (``scripts/export_gguf.py``); an EAGLE-3 head or a DFlash drafter through
                  llama.cpp's own converter, checked after (``scripts/export_gguf_convert.py``;
                  needs the target's folder, and the llama.cpp sources under ``.engines/``).
* ``medusa``      Medusa heads -> ``config.json`` + ``medusa_lm_head.safetensors``.
* ``eagle``       EAGLE head -> EAGLE-1 reference layout (vLLM / SGLang EAGLE loaders).
* ``eagle3``      EAGLE-3 head -> ``LlamaForCausalLMEagle3`` layout (vLLM ``method: eagle3``,
                  SGLang / SpecForge EAGLE-3 loaders).
* ``speculators`` EAGLE-3 head -> speculators ``eagle3`` format (``speculators_config``); an
                  EAGLE-1 head -> the stale speculators ``eagle`` type only with
                  ``legacy_speculators=true``.
* ``dflash``      DFlash drafter -> speculators ``dflash`` format (vLLM ``DFlashDraftModel``;
                  ``scripts/export_dflash.py``), always ``block_size - 1`` speculative tokens.

An EAGLE head exports exactly in the layout it was trained in: ``draft.config.layout=eagle1``
(the default; the final hidden state as input, the target's vocabulary) for ``eagle``,
``layout=eagle3`` (fused target layers, optionally a reduced vocabulary) for ``eagle3`` and
``speculators``; anything else is refused with the reasons, since the engines would silently
compute different drafts.

Every export holds ``manifest.json`` (sha256 and size of each file, draft family, target
identity, head and training config) and copies of ``speculation.json`` and ``token_frequency.json``
when the package has them.
``heads.exports.import_export(dir)`` loads any export back into draftsmith's heads.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import hydra
import torch
from safetensors import safe_open

from draftsmith.eval import CONF_DIR
from draftsmith.heads.exports import export_format, export_formats, format_families
from draftsmith.heads.family_base import DraftFamily, load_object
from draftsmith.heads.manifest import MANIFEST, write_manifest
from draftsmith.heads.package import FORMAT_VERSION, load_package
from draftsmith.heads.publish import staged
from draftsmith.heads.quantize import WEIGHT_ONLY, dequantize
from draftsmith.heads.vocab import TOKEN_FREQUENCY
from draftsmith.scripts.export_formats import (
    REFERENCE_FILES,
    REFERENCE_WITH_EMBEDDING,
    ExportError,
    WriteOptions,
    _write_json,
)

__all__ = ["ExportError", "OutPathError", "check_out", "export_package", "tensor_shapes"]

log = logging.getLogger(__name__)
ENGINES = ("vllm", "sglang")


class OutPathError(ValueError):
    """Writing the export to ``out`` would lose files (the package's or someone else's)."""


def check_out(draft: Path, out: Path, overwrite: bool = False) -> None:
    """Refuse an ``out`` whose replacement by the export would lose files.

    Refused: the package itself, a folder inside it or one holding it, a file, and a non-empty
    folder that is not a previous export of this package (``manifest.json`` with
    ``export_format`` and ``source_package`` = this package); a previous export only with
    ``overwrite``. New and empty folders are fine.

    Raises:
        OutPathError: naming the problem and the fix.
    """
    src, dst = draft.expanduser().resolve(), out.expanduser().resolve()
    new = f"pass a new folder outside the package, e.g. out={src.parent / (src.name + '-export')}"
    if dst == src:
        raise OutPathError(f"out={out} is the draft package itself: the export would replace it "
                           f"and its training config and logs would be lost; {new}")
    if src in dst.parents:
        raise OutPathError(f"out={out} is inside the draft package {draft}: the files written "
                           "there are not in the package's manifest, which would no longer "
                           f"load; {new}")
    if dst in src.parents:
        raise OutPathError(f"out={out} holds the draft package {draft}: the export replaces the "
                           f"whole out folder and would delete the package; {new}")
    if not dst.exists():
        return
    if not dst.is_dir():
        raise OutPathError(f"out={out} is a file: the export is a folder; pass a folder path")
    files = sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*"))
    if not files:
        return
    try:
        manifest = json.loads((dst / MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = {}
    manifest = manifest if isinstance(manifest, dict) else {}
    source = manifest.get("source_package")
    if not manifest.get("export_format") or not source:
        shown = ", ".join(files[:5]) + (", ..." if len(files) > 5 else "")
        raise OutPathError(f"out={out} is a non-empty folder that is not an export of {draft} "
                           f"({len(files)} entr{'y' if len(files) == 1 else 'ies'}: {shown}); "
                           "exporting would delete them. Pass "
                           "a new or empty folder, or remove this one yourself")
    if str(source) != str(draft) and Path(str(source)).expanduser().resolve() != src:
        raise OutPathError(f"out={out} holds an export of another package ({source}), not of "
                           f"{draft}; pass a new folder, or remove this one yourself")
    if not overwrite:
        raise OutPathError(f"out={out} already holds a {manifest['export_format']} export of "
                           f"{draft}; pass overwrite=true to replace it (atomically), or a new "
                           "folder")


# ----------------------------------------------------------------------------- helpers
def speculative_tokens(speculation: dict | None, family: DraftFamily, head_config: Any) -> int:
    """Draft length to advertise: K* from ``speculation.json`` when measured, else a default."""
    k_star = (speculation or {}).get("k_star")  # written by eval/measure.py
    if k_star is not None:
        return int(k_star)
    return family.default_draft_length(head_config)


# ----------------------------------------------------------------------------- export
def export_package(draft: str | Path, fmt: str, out: str | Path, target: Any = None,
                   engine: str = "vllm", num_speculative_tokens: int | None = None,
                   verifier: str | None = None, dtype: torch.dtype = torch.float32,
                   allow_unverified: bool = False, overwrite: bool = False,
                   legacy_speculators: bool = False,
                   gguf_vocab_from: str | Path | None = None,
                   reference_files: bool = False,
                   engines_dir: str | Path | None = None) -> Path:
    """Export a verified draft package to a serving-engine layout (written atomically).

    Args:
        draft: the draft package folder.
        fmt: one of ``heads.exports.export_formats()`` (the families' ``exports``).
        out: the export folder: new, empty, or (``overwrite``) a previous export of this same
            package; never the package itself, a folder inside it or one holding it
            (:func:`check_out`).
        target: optional ``LoadedTarget``; checked against the package and used for the tokenizer
            of ``hf`` exports whose package has none.
        engine: ``vllm`` or ``sglang`` (EAGLE-1 architecture name and fc-bias support).
        num_speculative_tokens: draft length advertised to engines; None = K* from
            ``speculation.json`` or the family default. A family that fixes it
            (``engine_draft_length``: a DFlash block) refuses any other value.
        verifier: the target's hub id or path as engines should load it; None = the loaded
            target's local folder when ``target`` is given, else the identity name (a warning:
            engines cannot load a bare name).
        dtype: weight dtype of the export.
        allow_unverified: export a package that fails its integrity check (warns loudly).
        overwrite: replace ``out`` when it holds a previous export of this package (atomically).
        legacy_speculators: allow ``format=speculators`` for an EAGLE-1 head (the stale ``eagle``
            type); EAGLE-3 heads get the current ``eagle3`` type without it.
        gguf_vocab_from: ``format=gguf``: the target's GGUF whose tokenizer the draft's copies
            (None: the packaged target GGUF, when it is the draft's target).
        reference_files: also write the files the authors' reference libraries read
            (``format=eagle``: ``pytorch_model.bin`` with the embedding; ``format=medusa``:
            ``medusa_lm_head.pt``); refused for other formats.
        engines_dir: ``format=gguf`` through llama.cpp's converter: where its environment and
            sources are (None: ``.engines/``).

    Raises:
        OutPathError: writing ``out`` would lose files (nothing was written).
    """
    if fmt not in export_formats():
        raise ValueError(f"unknown export format {fmt!r}; choose one of {export_formats()}")
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {ENGINES}")
    check_out(Path(draft), Path(out), overwrite)
    if reference_files and fmt not in REFERENCE_FILES:
        raise ValueError(f"reference_files=true adds {REFERENCE_FILES} files; format={fmt} has "
                         "no reference-library layout: drop reference_files")
    if (reference_files and REFERENCE_FILES[fmt] in REFERENCE_WITH_EMBEDDING
            and target is None):
        raise ValueError(f"reference_files=true for format={fmt} stores the target's embedding: "
                         "load the target (check_target=true or target_path=...)")
    pkg = load_package(draft, target=target, allow_unverified=allow_unverified)
    quant = pkg.info.get("quantization")
    if quant and quant.get("scheme") not in WEIGHT_ONLY:
        raise ValueError(f"draft={draft} is an {quant.get('scheme')} copy (scripts/quantize.py) "
                         "whose weights are quantized per call; engines load float layouts: "
                         "export the package it was made from")
    if quant:  # engines load float layouts: the weights the copy multiplies by
        dequantize(pkg.module)
        log.warning("draft=%s is an %s copy: the export holds its dequantized weights (what the "
                    "copy computes with), in %s", draft, quant["scheme"],
                    str(dtype).removeprefix("torch."))
    if fmt not in pkg.family.export_formats:
        names = " or ".join(f"'{f.name}'" for f in format_families(fmt))
        raise ValueError(f"format={fmt} exports {names} drafts, but {draft} "
                         f"holds a '{pkg.family.name}' draft; use format="
                         f"{' or '.join(pkg.family.export_formats)}")
    fixed = pkg.family.engine_draft_length(pkg.head_config)
    if fixed is not None and num_speculative_tokens not in (None, fixed):
        raise ExportError(f"num_speculative_tokens={num_speculative_tokens}: this "
                          f"{pkg.family.name} draft drafts {fixed} tokens a forward and engines "
                          f"size its block from this number; pass num_speculative_tokens={fixed} "
                          "or null")
    k = fixed or num_speculative_tokens or speculative_tokens(pkg.speculation, pkg.family,
                                                             pkg.head_config)
    if verifier is None and getattr(target, "path", None) is not None:
        verifier = str(Path(target.path).resolve())
    if verifier is None:
        verifier = pkg.info["target"]["name"]
        log.warning("the export names its target %r, which engines cannot load unless it is a "
                    "hub id or a path: pass verifier=<hub id or folder of the target>", verifier)
    out = Path(out)
    with staged(out) as tmp:
        opts = WriteOptions(dtype, k, verifier, engine, getattr(target, "tokenizer", None),
                            legacy_speculators,
                            None if gguf_vocab_from is None else str(gguf_vocab_from),
                            reference_files,
                            None if getattr(target, "path", None) is None else str(target.path),
                            None if engines_dir is None else str(engines_dir))
        load_object(export_format(fmt, pkg.family).writer)(pkg, tmp, opts)
        if pkg.speculation is not None:
            _write_json(tmp / "speculation.json", pkg.speculation)
        if (pkg.path / TOKEN_FREQUENCY).is_file():  # the draft vocabulary of speculation.json
            shutil.copyfile(pkg.path / TOKEN_FREQUENCY, tmp / TOKEN_FREQUENCY)
        src = (json.loads((pkg.path / MANIFEST).read_text()) if (pkg.path / MANIFEST).is_file()
               else {})
        write_manifest(tmp, {
            "format_version": FORMAT_VERSION, "export_format": fmt, "engine": engine,
            "draft_kind": pkg.family.name, "target": pkg.info["target"],
            "head_config": pkg.info["head_config"], "target_config": pkg.info.get("target_config"),
            "training_config": src.get("training_config"), "num_speculative_tokens": k,
            "dtype": str(dtype).removeprefix("torch."), "source_package": str(pkg.path),
            **({"dequantized_from": quant["scheme"]} if quant else {})})
        if pkg.info.get("signer") is not None:  # an unverified source gives an unsigned export
            from draftsmith.heads.signing import sign_folder
            sign_folder(tmp)
        else:
            log.warning("export %s left unsigned: its package was loaded without a trusted "
                        "signature", out)
    return out


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a safetensors file (without loading the data)."""
    with safe_open(str(path), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


# ----------------------------------------------------------------------------- command line
@hydra.main(config_path=str(CONF_DIR), config_name="export", version_base="1.3")
def main(cfg: Any) -> Path:
    """Command line: export ``cfg.draft`` as ``cfg.format`` into ``cfg.out``."""
    check_out(Path(cfg.draft), Path(cfg.out), bool(cfg.get("overwrite", False)))  # before loading
    target = None
    # the target's embedding goes into eagle-llm's reference file; llama.cpp's converter reads
    # its config and tokenizer (format=gguf of an EAGLE-3 head or a DFlash drafter)
    if (cfg.target_path is not None or cfg.check_target or cfg.get("reference_files")
            or cfg.format == "gguf"):
        from draftsmith.data.packaged import draft_target_path
        from draftsmith.data.target import load_target
        target = load_target(cfg.target_path or draft_target_path(cfg.draft))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}.get(cfg.dtype)
    if dtype is None:
        raise ValueError(f"dtype={cfg.dtype!r}: choose float32, bfloat16 or float16")
    out = export_package(cfg.draft, cfg.format, cfg.out, target=target, engine=cfg.engine,
                         num_speculative_tokens=cfg.num_speculative_tokens,
                         verifier=cfg.verifier, dtype=dtype,
                         allow_unverified=cfg.allow_unverified,
                         overwrite=bool(cfg.get("overwrite", False)),
                         legacy_speculators=bool(cfg.get("legacy_speculators", False)),
                         gguf_vocab_from=cfg.get("gguf_vocab_from"),
                         reference_files=bool(cfg.get("reference_files", False)))
    print(f"exported {cfg.draft} as format={cfg.format} to {out}")
    return out


if __name__ == "__main__":
    main()
