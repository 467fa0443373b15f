"""Export a draft package for serving engines.

    python scripts/export.py draft=outputs/eagle/package format=eagle out=exports/eagle

Formats (layouts and their sources: ``scripts/export_layouts.py``; file names and the draft
family of each format: ``heads/exports.py``):

* ``hf``          draft LM -> transformers model dir (``assistant_model`` in ``generate``).
* ``medusa``      Medusa heads -> ``config.json`` + ``medusa_lm_head.safetensors``.
* ``eagle``       EAGLE head -> EAGLE-1 reference layout (vLLM / SGLang EAGLE loaders).
* ``speculators`` EAGLE head -> speculators ``eagle`` format (``speculators_config``).

EAGLE heads export exactly only when trained with ``draft.config.layout=eagle1`` (the default),
the final hidden state as input and the target's vocabulary; anything else is refused with the
reasons, since the engines would silently compute different drafts.

Every export holds ``manifest.json`` (sha256 and size of each file, draft family, target
identity, head and training config) and copies of ``speculation.json`` and ``token_frequency.json``
when the package has them.
``heads.exports.import_export(dir)`` loads any export back into draftsmith's heads.
"""
from __future__ import annotations

import json
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from heads.exports import (
    EAGLE1_LAYER_KEYS,
    FORMATS,
    MEDUSA_WEIGHTS,
    WEIGHTS,
    format_family,
    rename_prefix,
)
from heads.family import DraftFamily
from heads.package import (
    FORMAT_VERSION,
    MANIFEST,
    DraftPackage,
    load_package,
    staged,
    write_manifest,
)
from heads.vocab import TOKEN_FREQUENCY

log = logging.getLogger(__name__)
ENGINES = ("vllm", "sglang")
# EAGLE-1 config.json architectures per engine: vLLM renames "LlamaForCausalLM" to
# "EagleLlamaForCausalLM" itself (configs/eagle.py); SGLang registers "LlamaForCausalLMEagle".
EAGLE_ARCH = {"vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja")


class ExportError(ValueError):
    """The draft cannot be written in the requested format without changing what it computes."""


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


def readable_by_older_loaders(cfg: dict) -> dict:
    """A config both transformers 5 and the 4.x loaders inside engines read the same way:
    transformers 5 keeps the RoPE base only in ``rope_parameters``, and 4.x, finding no
    ``rope_theta``, silently uses 10,000 (SmolLM2 needs 100,000): write both."""
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") not in ("default", None) and "rope_scaling" not in cfg:
        cfg["rope_scaling"] = dict(rope)
    return cfg


def _layer_config(target_config: dict) -> dict:
    """The target's config cut to the head's single decoder layer."""
    cfg = {k: v for k, v in target_config.items() if not k.startswith("_")}
    cfg.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"])
    cfg.pop("layer_types", None)
    return readable_by_older_loaders(cfg)


# transformers 5 names its tokenizer class TokenizersBackend; 4.x refuses that name and loads
# the same tokenizer.json as PreTrainedTokenizerFast
NEW_TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def _portable_tokenizer_config(folder: Path) -> None:
    path = folder / "tokenizer_config.json"
    if path.is_file():
        cfg = json.loads(path.read_text())
        if cfg.get("tokenizer_class") in NEW_TOKENIZER_CLASSES:
            cfg["tokenizer_class"] = NEW_TOKENIZER_CLASSES[cfg["tokenizer_class"]]
            _write_json(path, cfg)


def eagle1_incompatibilities(pkg: DraftPackage, engine: str) -> list[str]:
    """Why an EAGLE head would compute something else under the EAGLE-1 layout (empty = exact).

    Args:
        pkg: a loaded EAGLE draft package.
        engine: ``vllm`` (fc without bias: a non-zero bias would be dropped) or ``sglang``.
    """
    head, cfg = pkg.module, pkg.head_config
    why = []
    if cfg.layout != "eagle1":
        why.append(f"layout={cfg.layout}: the head was trained with an input norm, an output norm "
                   "and an fc bias that EAGLE-1 engines do not have; retrain it with "
                   "draft.config.layout=eagle1 to get an exportable head")
    no_layout = ("no engine layout draftsmith can write expresses it (EAGLE-3 engines fuse the "
                 "embedding inside attention, not in fc)")
    if cfg.fuse_layers is not None:
        why.append(f"fuse_layers={cfg.fuse_layers}: EAGLE-1 reads only the final hidden state "
                   f"(fc is Linear(2H, H)) and {no_layout}; train with "
                   "draft.config.fuse_layers=null")
    if cfg.draft_vocab_size is not None:
        why.append(f"draft_vocab_size={cfg.draft_vocab_size}: EAGLE-1 engines use the target's LM "
                   f"head and have no d2t/t2d map, and {no_layout}; train with "
                   "draft.config.draft_vocab_size=null")
    if not isinstance(head.layer.input_layernorm, nn.Identity):
        why.append("layer.input_layernorm: the head normalises the fused input before attention, "
                   "but EAGLE-1 engines skip layer 0's input norm (vllm llama_eagle.py, sglang "
                   "llama_eagle.py)")
    if not isinstance(getattr(head, "norm", None), (nn.Identity, type(None))):
        why.append("norm: the head normalises its output feature, but EAGLE-1 engines return "
                   "the decoder layer's output unnormalised")
    if engine == "vllm" and head.fc.bias is not None and bool(head.fc.bias.detach().any()):
        why.append("fc.bias is non-zero, but vllm's EagleLlamaForCausalLM builds fc without a "
                   "bias and would drop it (use engine=sglang, whose fc has a bias)")
    return why


def _refuse(why: list[str], fmt: str) -> None:
    if why:
        raise ExportError(f"this EAGLE head has no exact {fmt} export:\n  - " + "\n  - ".join(why)
                          + "\nThe engines would compute different drafts; nothing was written.")


def _ours_to_eagle1(state: dict[str, torch.Tensor], hidden: int,
                    zero_bias: bool = False) -> dict[str, torch.Tensor]:
    """draftsmith EAGLE names -> EAGLE-1 names; fc input order [feature, emb] -> [emb, feature].

    ``zero_bias`` writes an all-zero ``fc.bias`` (H,) for a bias-free head, for loaders that always
    build fc with a bias (SGLang) and would otherwise leave it at its random initialisation.
    """
    w = state["fc.weight"]  # (H, 2H) over [feature | embedding]
    out = {"fc.weight": torch.cat([w[:, hidden:], w[:, :hidden]], dim=1).contiguous()}
    if "fc.bias" in state:
        out["fc.bias"] = state["fc.bias"]
    elif zero_bias:
        out["fc.bias"] = torch.zeros(hidden, dtype=w.dtype)
    for key in EAGLE1_LAYER_KEYS:
        out[f"layers.0.{key}"] = state[f"layer.{key}"]
    return out


def medusa_to_reference(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """``heads.{i}.blocks.{j}.linear.*`` / ``heads.{i}.lm_head.weight`` -> ``{i}.{j}.linear.*`` /
    ``{i}.{N}.weight`` (Medusa's ``nn.Sequential`` numbering)."""
    out = {}
    for k, v in state.items():
        parts = k.split(".")
        if parts[2] == "lm_head":
            out[f"{parts[1]}.{num_layers}.weight"] = v
        else:  # heads.i.blocks.j.linear.{weight,bias}
            out[f"{parts[1]}.{parts[3]}.linear.{parts[-1]}"] = v
    return out


def _save(state: dict[str, torch.Tensor], path: Path, dtype: torch.dtype) -> None:
    save_file({k: v.detach().to("cpu", dtype).contiguous().clone() for k, v in state.items()},
              str(path), metadata={"format": "pt"})


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------- writers
@dataclass(frozen=True)
class WriteOptions:
    """What a writer needs besides the package: weight dtype, advertised draft length, the
    verifier's name or path, the engine (EAGLE-1 flavour) and the target's tokenizer."""

    dtype: torch.dtype
    k: int
    verifier: str
    engine: str
    tokenizer: Any = None
    legacy_speculators: bool = False


def _write_hf(pkg: DraftPackage, tmp: Path, opts: WriteOptions) -> None:
    dtype, tokenizer = opts.dtype, opts.tokenizer
    model = pkg.module.to(dtype)
    model.generation_config.num_assistant_tokens = opts.k
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.save_pretrained(tmp, safe_serialization=True)
    copied = [n for n in TOKENIZER_FILES if (pkg.path / n).is_file()]
    for name in copied:
        shutil.copy2(pkg.path / name, tmp / name)
    if not copied and tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    _write_json(tmp / "config.json",
                readable_by_older_loaders(json.loads((tmp / "config.json").read_text())))
    _portable_tokenizer_config(tmp)


def _write_medusa(pkg: DraftPackage, tmp: Path, opts: WriteOptions) -> None:
    dtype, verifier = opts.dtype, opts.verifier
    cfg, ident = pkg.head_config, pkg.info["target"]
    state = medusa_to_reference(pkg.module.state_dict(), cfg.num_layers)
    _save(state, tmp / MEDUSA_WEIGHTS, dtype)
    _write_json(tmp / "config.json", {
        "architectures": ["MedusaModel"], "model_type": "medusa",
        "medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers,
        "base_model_name_or_path": verifier, "hidden_size": ident["hidden_size"],
        "vocab_size": ident["vocab_size"], "medusa_fc_bias": True,
        "torch_dtype": str(dtype).removeprefix("torch.")})


def _write_eagle(pkg: DraftPackage, tmp: Path, opts: WriteOptions) -> None:
    dtype, engine = opts.dtype, opts.engine
    _refuse(eagle1_incompatibilities(pkg, engine), "EAGLE-1")
    h = pkg.info["target"]["hidden_size"]
    # SGLang's fc always has a bias: give a bias-free head an explicit zero one
    state = _ours_to_eagle1(pkg.module.state_dict(), h, zero_bias=engine == "sglang")
    _save(state, tmp / WEIGHTS, dtype)
    cfg = _layer_config(pkg.info["target_config"])
    cfg.update(architectures=[EAGLE_ARCH[engine]], bias="fc.bias" in state,
               torch_dtype=str(dtype).removeprefix("torch."))
    _write_json(tmp / "config.json", cfg)


STALE_SPECULATORS = (
    "format=speculators writes speculators' 'eagle' type, which speculators dropped after 0.4.0.1 "
    "and vLLM 0.32 refuses ('Expected one of: eagle3, peagle, dflash, dflash2, dspark'); serve "
    "this head in vLLM with format=eagle (speculative_config method 'eagle'), or pass "
    "legacy_speculators=true for speculators <= 0.4.0.1")


def _write_speculators(pkg: DraftPackage, tmp: Path, opts: WriteOptions) -> None:
    if not opts.legacy_speculators:
        raise ExportError(STALE_SPECULATORS)
    dtype, k, verifier = opts.dtype, opts.k, opts.verifier
    # vllm serves this format with its EAGLE-1 model, whose fc has no bias
    _refuse(eagle1_incompatibilities(pkg, engine="vllm"), "speculators 'eagle'")
    h = pkg.info["target"]["hidden_size"]
    state = rename_prefix(rename_prefix(_ours_to_eagle1(pkg.module.state_dict(), h), "fc.",
                                        "fusion_fc."), "layers.0.", "transformer.")
    _save(state, tmp / WEIGHTS, dtype)
    import transformers
    layer_cfg = _layer_config(pkg.info["target_config"])
    _write_json(tmp / "config.json", {
        "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
        "speculators_model_type": "eagle", "speculators_version": "0.1.0",
        "transformer_layer_architecture": "LlamaDecoderLayer",
        "transformer_layer_config": layer_cfg, "layernorms": False,
        "fusion_bias": "fusion_fc.bias" in state,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "transformers_version": transformers.__version__,
        "speculators_config": {
            "algorithm": "eagle",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier,
                         "architectures": pkg.info["target_config"].get("architectures")
                         or ["LlamaForCausalLM"]}}})


WRITERS = {"hf": _write_hf, "medusa": _write_medusa, "eagle": _write_eagle,
           "speculators": _write_speculators}


# ----------------------------------------------------------------------------- export
def export_package(draft: str | Path, fmt: str, out: str | Path, target: Any = None,
                   engine: str = "vllm", num_speculative_tokens: int | None = None,
                   verifier: str | None = None, dtype: torch.dtype = torch.float32,
                   allow_unverified: bool = False, overwrite: bool = False,
                   legacy_speculators: bool = False) -> Path:
    """Export a verified draft package to a serving-engine layout (written atomically).

    Args:
        draft: the draft package folder.
        fmt: one of ``FORMATS``.
        out: the export folder: new, empty, or (``overwrite``) a previous export of this same
            package; never the package itself, a folder inside it or one holding it
            (:func:`check_out`).
        target: optional ``LoadedTarget``; checked against the package and used for the tokenizer
            of ``hf`` exports whose package has none.
        engine: ``vllm`` or ``sglang`` (EAGLE-1 architecture name and fc-bias support).
        num_speculative_tokens: draft length advertised to engines; None = K* from
            ``speculation.json`` or the family default.
        verifier: the target's hub id or path as engines should load it; None = the loaded
            target's local folder when ``target`` is given, else the identity name (a warning:
            engines cannot load a bare name).
        dtype: weight dtype of the export.
        allow_unverified: export a package that fails its integrity check (warns loudly).
        overwrite: replace ``out`` when it holds a previous export of this package (atomically).
        legacy_speculators: allow ``format=speculators`` (the stale ``eagle`` type).

    Raises:
        OutPathError: writing ``out`` would lose files (nothing was written).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {FORMATS}")
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {ENGINES}")
    check_out(Path(draft), Path(out), overwrite)
    if fmt == "speculators" and not legacy_speculators:
        raise ExportError(STALE_SPECULATORS)  # before loading anything
    pkg = load_package(draft, target=target, allow_unverified=allow_unverified)
    if pkg.info.get("quantization"):
        raise ValueError(f"draft={draft} is an {pkg.info['quantization'].get('scheme')} copy "
                         "(scripts/quantize.py); engines load float layouts: export the package "
                         "it was made from")
    if fmt not in pkg.family.export_formats:
        raise ValueError(f"format={fmt} exports '{format_family(fmt).name}' drafts, but {draft} "
                         f"holds a '{pkg.kind}' draft; use format="
                         f"{' or '.join(pkg.family.export_formats)}")
    k = num_speculative_tokens or speculative_tokens(pkg.speculation, pkg.family,
                                                     pkg.head_config)
    if verifier is None and getattr(target, "path", None) is not None:
        verifier = str(Path(target.path).resolve())
    if verifier is None:
        verifier = pkg.info["target"]["name"]
        log.warning("the export names its target %r, which engines cannot load unless it is a "
                    "hub id or a path: pass verifier=<hub id or folder of the target>", verifier)
    out = Path(out)
    with staged(out) as tmp:
        WRITERS[fmt](pkg, tmp, WriteOptions(dtype, k, verifier, engine,
                                            getattr(target, "tokenizer", None),
                                            legacy_speculators))
        if pkg.speculation is not None:
            _write_json(tmp / "speculation.json", pkg.speculation)
        if (pkg.path / TOKEN_FREQUENCY).is_file():  # the draft vocabulary of speculation.json
            shutil.copyfile(pkg.path / TOKEN_FREQUENCY, tmp / TOKEN_FREQUENCY)
        src = (json.loads((pkg.path / MANIFEST).read_text()) if (pkg.path / MANIFEST).is_file()
               else {})
        write_manifest(tmp, {
            "format_version": FORMAT_VERSION, "export_format": fmt, "engine": engine,
            "draft_kind": pkg.kind, "target": pkg.info["target"],
            "head_config": pkg.info["head_config"], "target_config": pkg.info.get("target_config"),
            "training_config": src.get("training_config"), "num_speculative_tokens": k,
            "dtype": str(dtype).removeprefix("torch."), "source_package": str(pkg.path)})
        if pkg.info.get("signer") is not None:  # an unverified source gives an unsigned export
            from heads.signing import sign_folder
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
@hydra.main(config_path="../conf/eval", config_name="export", version_base="1.3")
def main(cfg: Any) -> Path:
    """Command line: export ``cfg.draft`` as ``cfg.format`` into ``cfg.out``."""
    check_out(Path(cfg.draft), Path(cfg.out), bool(cfg.get("overwrite", False)))  # before loading
    target = None
    if cfg.target_path is not None or cfg.check_target:
        from data.target import load_target
        target = load_target(cfg.target_path)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}.get(cfg.dtype)
    if dtype is None:
        raise ValueError(f"dtype={cfg.dtype!r}: choose float32, bfloat16 or float16")
    out = export_package(cfg.draft, cfg.format, cfg.out, target=target, engine=cfg.engine,
                         num_speculative_tokens=cfg.num_speculative_tokens,
                         verifier=cfg.verifier, dtype=dtype,
                         allow_unverified=cfg.allow_unverified,
                         overwrite=bool(cfg.get("overwrite", False)),
                         legacy_speculators=bool(cfg.get("legacy_speculators", False)))
    print(f"exported {cfg.draft} as format={cfg.format} to {out}")
    return out


if __name__ == "__main__":
    main()
