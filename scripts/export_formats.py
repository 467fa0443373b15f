"""The writers of ``scripts/export.py``: one function per export format, and the conversions
from draftsmith's tensor names to each engine's (layouts and their sources:
``scripts/export_layouts.py``).

Each writer ``(pkg, tmp, opts)`` writes the format's files into the staging folder ``tmp``;
``scripts/export.py`` checks the output path, loads and verifies the package, stages, adds the
manifest and signs.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from draftsmith.heads.exports import (
    EAGLE1_LAYER_KEYS,
    EAGLE3_LAYER_KEYS,
    EAGLE3_LAYER_PREFIX,
    fc_columns,
    rename_prefix,
)
from draftsmith.heads.medusa import MEDUSA_WEIGHTS
from draftsmith.heads.package import DraftPackage
from draftsmith.heads.weights import WEIGHTS

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose eagle3 config this writes
# EAGLE-1 config.json architectures per engine: vLLM renames "LlamaForCausalLM" to
# "EagleLlamaForCausalLM" itself (configs/eagle.py); SGLang registers "LlamaForCausalLMEagle".
EAGLE_ARCH = {"vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja")


class ExportError(ValueError):
    """The draft cannot be written in the requested format without changing what it computes."""


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


def _layer_config(pkg: DraftPackage) -> dict:
    """The head's single Llama-style decoder layer, derived from the target's config (any
    architecture: ``heads.draft_config.draft_layer_config``) with the head's own MLP width,
    every field explicit."""
    from draftsmith.heads.draft_config import draft_layer_config

    derived = draft_layer_config(pkg.info["target_config"]).to_dict()
    own = getattr(pkg.head_config, "intermediate_size", None)
    if own is not None:
        derived["intermediate_size"] = int(own)
    cfg = {k: v for k, v in derived.items() if not k.startswith("_")}
    cfg.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"], model_type="llama")
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
    if cfg.layout == "eagle3":
        return [("layout=eagle3: the head is an EAGLE-3 head (embedding inside attention); export "
                "it with format=eagle3 or format=speculators")]
    if cfg.layout != "eagle1":
        why.append(f"layout={cfg.layout}: the head was trained with an input norm, an output norm "
                   "and an fc bias that EAGLE-1 engines do not have; retrain it with "
                   "draft.config.layout=eagle1 to get an exportable head")
    no_layout = ("the EAGLE-3 layouts need the EAGLE-3 layer (embedding inside attention, not in "
                 "fc): retrain with draft.config.layout=eagle3 for format=eagle3")
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


def eagle3_incompatibilities(pkg: DraftPackage) -> list[str]:
    """Why an EAGLE head would compute something else under the EAGLE-3 layout (empty = exact)."""
    cfg = pkg.head_config
    if cfg.layout != "eagle3":
        return [(f"layout={cfg.layout}: EAGLE-3 engines feed the embedding to attention beside the "
                "fused features (q/k/v read 2H), this head fuses it in fc; export it with "
                "format=eagle, or retrain with draft.config.layout=eagle3")]
    return fused_layer_incompatibilities(pkg, "EAGLE-3 engines capture")


def fused_layer_incompatibilities(pkg: DraftPackage, capture: str) -> list[str]:
    """Why an engine would feed a head other features than the target layers it fuses
    (``head_config.fuse_layers``): the final layer id, whose hidden state transformers gives
    after the final norm while engines capture every layer before it, or a repeated id.
    ``capture`` says who captures (``"vLLM captures"``)."""
    n_layers = pkg.info["target"]["num_layers"]
    ids = list(pkg.head_config.fuse_layers)
    why = []
    if n_layers in ids:
        why.append(f"fuse_layers={ids} holds {n_layers}, the target's final hidden state after "
                   f"its final norm; {capture} every layer before that norm (the residual "
                   f"stream), so the final one would be fed un-normed: use layer ids below "
                   f"{n_layers}, e.g. [2, {n_layers // 2}, {n_layers - 3}]")
    if len(set(ids)) != len(ids):
        why.append(f"fuse_layers={ids} repeats a layer; {capture} each layer once")
    return why


def _refuse(why: list[str], fmt: str, what: str = "EAGLE head") -> None:
    if why:
        raise ExportError(f"this {what} has no exact {fmt} export:\n  - " + "\n  - ".join(why)
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


def _ours_to_eagle3(state: dict[str, torch.Tensor], layer_prefix: str,
                    fuse_layers: list[int]) -> dict[str, torch.Tensor]:
    """draftsmith eagle3 names -> an EAGLE-3 layout's; ``fc`` columns in ascending layer order
    (the order engines concatenate the captured layers in); ``d2t`` as offsets
    ``target id - draft id`` (vLLM, SGLang and speculators add it to the draft id)."""
    out = {"fc.weight": fc_columns(state["fc.weight"], fuse_layers, sorted(fuse_layers)),
           "norm.weight": state["norm.weight"], "lm_head.weight": state["lm_head.weight"]}
    for key in EAGLE3_LAYER_KEYS:
        out[f"{layer_prefix}{key}"] = state[f"layer.{key}"]
    if "d2t" in state:
        d2t = state["d2t"].long()
        out["d2t"] = d2t - torch.arange(d2t.numel())
        out["t2d"] = state["t2d"].bool()
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


def _cpu(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies: float tensors in ``dtype``, integer and bool tensors (``d2t``,
    ``t2d``) as they are."""
    return {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype)
            .contiguous().clone() for k, v in state.items()}


def _save(state: dict[str, torch.Tensor], path: Path, dtype: torch.dtype) -> None:
    save_file(_cpu(state, dtype), str(path), metadata={"format": "pt"})


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------- writers
@dataclass(frozen=True)
class WriteOptions:
    """What a writer needs besides the package: weight dtype, advertised draft length, the
    verifier's name or path, the engine (EAGLE-1 flavour), the target's tokenizer, and the GGUF
    whose tokenizer a ``gguf`` export copies (None: the packaged target's), whether to add
    the authors' reference files (``REFERENCE_FILES``), and for a ``gguf`` made by llama.cpp's
    converter the target's folder and the engines' folder (``scripts/export_gguf_convert.py``)."""

    dtype: torch.dtype
    k: int
    verifier: str
    engine: str
    tokenizer: Any = None
    legacy_speculators: bool = False
    gguf_vocab_from: str | None = None
    reference_files: bool = False
    target_dir: str | None = None
    engines_dir: str | None = None


def _write_gguf(pkg: DraftPackage, tmp: Path, opts: WriteOptions) -> None:
    from draftsmith.scripts.export_gguf import DTYPES, GGUF_FILE, vocab_source, write_gguf

    if opts.dtype not in DTYPES:
        raise ExportError(f"format=gguf writes float32 or float16 weights, not {opts.dtype}: "
                          "pass dtype=float32 or dtype=float16")
    try:
        source = vocab_source(pkg.info["target"], opts.gguf_vocab_from)
    except ValueError as e:
        raise ExportError(str(e)) from e
    write_gguf(pkg.module, tmp / GGUF_FILE, opts.dtype, source,
               name=f"draftsmith draft for {pkg.info['target']['name']}")


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


# Extra files in the layouts the authors' reference libraries read (``reference_files=true``):
# eagle-llm 1.2.1 ``EaModel`` loads ``pytorch_model.bin`` with the embedding among the head's
# tensors; medusa-llm 0.1 loads ``medusa_lm_head.pt``. Neither library runs SmolLM2 correctly
# (README, "Engines"): the files serve other targets and other tools that read those names.
REFERENCE_FILES = {"eagle": "pytorch_model.bin", "medusa": "medusa_lm_head.pt"}
# the reference files that hold the target's embedding (the package must be loaded with it)
REFERENCE_WITH_EMBEDDING = ("pytorch_model.bin",)


def _write_medusa(pkg: DraftPackage, tmp: Path, opts: WriteOptions) -> None:
    dtype, verifier = opts.dtype, opts.verifier
    cfg, ident = pkg.head_config, pkg.info["target"]
    if not pkg.module.target_attached:  # the layout stores an LM head per head: the target's
        raise ExportError("these Medusa heads share the target's LM head, which the medusa layout "
                          "stores once per head: load the target (check_target=true, or "
                          "target_path=... for a target other than the packaged one)")
    state = medusa_to_reference(pkg.module.per_head_state_dict(), cfg.num_layers)
    _save(state, tmp / MEDUSA_WEIGHTS, dtype)
    if opts.reference_files:
        torch.save(_cpu(state, dtype), tmp / REFERENCE_FILES["medusa"])
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
    if opts.reference_files:  # the reference EAGLE model keeps the embedding in the head file
        emb = {"embed_tokens.weight": pkg.module.embed_tokens.weight}
        torch.save(_cpu({**state, **emb}, dtype), tmp / REFERENCE_FILES["eagle"])
    cfg = _layer_config(pkg)
    cfg.update(architectures=[EAGLE_ARCH[engine]], bias="fc.bias" in state,
               torch_dtype=str(dtype).removeprefix("torch."))
    _write_json(tmp / "config.json", cfg)


def _eagle3_config(pkg: DraftPackage, dtype: torch.dtype, engine: str = "vllm") -> tuple[dict,
                                                                                         dict]:
    """The EAGLE-3 layer config (the target's, cut to one layer, with the draft vocabulary) and
    the fused layer ids as the engine counts them: vLLM and speculators name transformers'
    ``hidden_states[i]`` (the input of layer i) by i, SGLang by i - 1 (it captures the input of
    layer ``id + 1``)."""
    cfg, ident = pkg.head_config, pkg.info["target"]
    layer_cfg = _layer_config(pkg)
    layer_cfg.update(draft_vocab_size=int(cfg.draft_vocab_size or ident["vocab_size"]),
                     target_hidden_size=ident["hidden_size"], tie_word_embeddings=False,
                     torch_dtype=str(dtype).removeprefix("torch."))
    shift = 1 if engine == "sglang" else 0
    return layer_cfg, {"eagle_aux_hidden_state_layer_ids":
                       [i - shift for i in sorted(cfg.fuse_layers)],
                       "use_aux_hidden_state": True}


def _save_eagle3(pkg: DraftPackage, tmp: Path, opts: WriteOptions, fmt: str, name: str) -> None:
    """Refuse what the EAGLE-3 layout cannot express, then write the weights under ``fmt``'s
    layer prefix."""
    _refuse(eagle3_incompatibilities(pkg), name)
    state = _ours_to_eagle3(pkg.module.state_dict(), EAGLE3_LAYER_PREFIX[fmt],
                            list(pkg.head_config.fuse_layers))
    _save(state, tmp / WEIGHTS, opts.dtype)


def _write_eagle3(pkg: DraftPackage, tmp: Path, opts: WriteOptions) -> None:
    _save_eagle3(pkg, tmp, opts, "eagle3", "EAGLE-3")
    cfg, eagle = _eagle3_config(pkg, opts.dtype, opts.engine)
    cfg.update(architectures=["LlamaForCausalLMEagle3"], eagle_config=eagle,
               norm_before_residual=False)
    _write_json(tmp / "config.json", cfg)


STALE_SPECULATORS = (
    "format=speculators writes speculators' 'eagle' type for an EAGLE-1 head, which speculators "
    "dropped after 0.4.0.1 and vLLM 0.32 refuses ('Expected one of: eagle3, peagle, dflash, "
    "dflash2, dspark'); serve this head in vLLM with format=eagle (speculative_config method "
    "'eagle'), train an EAGLE-3 head (draft.config.layout=eagle3) for speculators' 'eagle3' type, "
    "or pass legacy_speculators=true for speculators <= 0.4.0.1")


def _speculators_config(pkg: DraftPackage, opts: WriteOptions, algorithm: str) -> dict:
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": opts.k,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": opts.verifier,
                         "architectures": verifier_architectures(pkg.info["target_config"])}}


def verifier_architectures(target_config: dict) -> list[str]:
    """The verifier's own architecture names: its config's ``architectures``, else the causal-LM
    class transformers maps its ``model_type`` to."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    named = target_config.get("architectures")
    if named:
        return list(named)
    return [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(target_config.get("model_type", "llama"),
                                                  "LlamaForCausalLM")]


def _write_speculators_eagle3(pkg: DraftPackage, tmp: Path, opts: WriteOptions) -> None:
    _save_eagle3(pkg, tmp, opts, "speculators", "speculators 'eagle3'")
    import transformers
    layer_cfg, eagle = _eagle3_config(pkg, opts.dtype)
    _write_json(tmp / "config.json", {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer_cfg,
        "draft_vocab_size": layer_cfg["draft_vocab_size"],
        "target_hidden_size": layer_cfg["target_hidden_size"], "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": eagle["eagle_aux_hidden_state_layer_ids"],
        "torch_dtype": str(opts.dtype).removeprefix("torch."),
        "transformers_version": transformers.__version__,
        "speculators_config": _speculators_config(pkg, opts, "eagle3")})


def _write_speculators(pkg: DraftPackage, tmp: Path, opts: WriteOptions) -> None:
    if pkg.head_config.layout == "eagle3":
        _write_speculators_eagle3(pkg, tmp, opts)
        return
    if not opts.legacy_speculators:
        raise ExportError(STALE_SPECULATORS)
    dtype = opts.dtype
    # vllm serves this format with its EAGLE-1 model, whose fc has no bias
    _refuse(eagle1_incompatibilities(pkg, engine="vllm"), "speculators 'eagle'")
    h = pkg.info["target"]["hidden_size"]
    state = rename_prefix(rename_prefix(_ours_to_eagle1(pkg.module.state_dict(), h), "fc.",
                                        "fusion_fc."), "layers.0.", "transformer.")
    _save(state, tmp / WEIGHTS, dtype)
    import transformers
    layer_cfg = _layer_config(pkg)
    _write_json(tmp / "config.json", {
        "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
        "speculators_model_type": "eagle", "speculators_version": "0.1.0",
        "transformer_layer_architecture": "LlamaDecoderLayer",
        "transformer_layer_config": layer_cfg, "layernorms": False,
        "fusion_bias": "fusion_fc.bias" in state,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "transformers_version": transformers.__version__,
        "speculators_config": _speculators_config(pkg, opts, "eagle")})
