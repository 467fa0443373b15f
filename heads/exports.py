"""Read an export back into draftsmith's heads, and the layout facts writer and reader share.

``scripts/export.py`` writes a draft package in a serving engine's layout (``hf``, ``medusa``,
``eagle``, ``eagle3``, ``speculators``, ``dflash``); :func:`import_export` loads such a folder as
the same :class:`~heads.package.DraftPackage` that :func:`heads.package.load_package` returns, so
``eval/decode.py draft=EXPORT`` decodes from it. The full layout specification (config keys,
tensor names and shapes, sources) is ``scripts/export_layouts.py``.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from draftsmith.data.identity import TargetIdentity
from draftsmith.heads.family import FAMILIES, get_family
from draftsmith.heads.family_base import DraftFamily, ExportFormat, load_object
from draftsmith.heads.manifest import listed
from draftsmith.heads.package import DraftPackage, check_target, target_config, verify_package

# Tensors of the EAGLE-1 decoder layer (``layers.0.*``; draftsmith's head names it ``layer.*``).
EAGLE1_LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                     "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
                     "mlp.up_proj.weight", "mlp.down_proj.weight",
                     "post_attention_layernorm.weight")


# Tensors of the EAGLE-3 decoder layer (``midlayer.*`` in the EAGLE-3 layout, ``layers.0.*`` in
# speculators'; draftsmith's eagle3 head names it ``layer.*``).
EAGLE3_LAYER_KEYS = EAGLE1_LAYER_KEYS + ("input_layernorm.weight", "hidden_norm.weight")
# The layer prefix of each EAGLE-3 format.
EAGLE3_LAYER_PREFIX = {"eagle3": "midlayer.", "speculators": "layers.0."}


def export_formats() -> tuple[str, ...]:
    """Every export format of the registered families (``DraftFamily.exports``; ``gguf`` is
    llama.cpp's file for every family it runs, named once)."""
    return tuple(dict.fromkeys(fmt for family in FAMILIES.values()
                               for fmt in family.export_formats))


def format_families(fmt: str) -> tuple[DraftFamily, ...]:
    """The families whose drafts ``fmt`` holds: one per format, but ``gguf``."""
    found = tuple(f for f in FAMILIES.values() if fmt in f.export_formats)
    if not found:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {export_formats()}")
    return found


def format_family(fmt: str) -> DraftFamily:
    """The (first) family whose drafts ``fmt`` holds (``DraftFamily.exports``)."""
    return format_families(fmt)[0]


def export_format(fmt: str, family: DraftFamily | None = None) -> ExportFormat:
    """The record of ``fmt`` (of ``family``'s drafts: a ``gguf`` is written and run differently
    per family): its writer, reader, weights file and engine."""
    return next(e for e in (family or format_family(fmt)).exports if e.name == fmt)


def rename_prefix(state: dict[str, torch.Tensor], old: str,
                  new: str) -> dict[str, torch.Tensor]:
    """``state`` with the key prefix ``old`` replaced by ``new`` (other keys unchanged)."""
    return {(new + k[len(old):] if k.startswith(old) else k): v for k, v in state.items()}


def medusa_from_reference(state: dict[str, torch.Tensor],
                          num_layers: int) -> dict[str, torch.Tensor]:
    """Medusa's ``{i}.{j}.linear.*`` / ``{i}.{N}.weight`` -> ``heads.{i}.blocks.{j}.linear.*`` /
    ``heads.{i}.lm_head.weight``."""
    out = {}
    for k, v in state.items():
        parts = k.split(".")
        if parts[1] == str(num_layers):
            out[f"heads.{parts[0]}.lm_head.weight"] = v
        else:
            out[f"heads.{parts[0]}.blocks.{parts[1]}.linear.{parts[-1]}"] = v
    return out


def eagle1_to_ours(state: dict[str, torch.Tensor], hidden: int,
                   with_bias: bool) -> dict[str, torch.Tensor]:
    """EAGLE-1 names -> draftsmith names, for a head whose fc has a bias iff ``with_bias``."""
    w = state["fc.weight"]  # (H, 2H) over [embedding | feature]
    out = {"fc.weight": torch.cat([w[:, hidden:], w[:, :hidden]], dim=1).contiguous()}
    bias = state.get("fc.bias")
    if with_bias:
        out["fc.bias"] = bias if bias is not None else torch.zeros(hidden, dtype=w.dtype)
    elif bias is not None and bool(bias.any()):
        raise ValueError("the export's fc.bias is non-zero but its head config has no fc bias "
                         "(layout=eagle1); the export was not written by this exporter")
    for key in EAGLE1_LAYER_KEYS:
        out[f"layer.{key}"] = state[f"layers.0.{key}"]
    return out


def eagle3_to_ours(state: dict[str, torch.Tensor], layer_prefix: str,
                   fuse_layers: list[int]) -> dict[str, torch.Tensor]:
    """EAGLE-3 names -> draftsmith names (inverse of ``scripts/export.py``'s ``_ours_to_eagle3``):
    ``fc`` columns from ascending layer order back to ``fuse_layers`` order, ``d2t`` from offsets
    (``target id - draft id``) back to target ids."""
    out = {"fc.weight": fc_columns(state["fc.weight"], sorted(fuse_layers), fuse_layers),
           "norm.weight": state["norm.weight"], "lm_head.weight": state["lm_head.weight"]}
    for key in EAGLE3_LAYER_KEYS:
        out[f"layer.{key}"] = state[f"{layer_prefix}{key}"]
    if "d2t" in state:
        out["d2t"] = state["d2t"].long() + torch.arange(state["d2t"].numel())
        out["t2d"] = state["t2d"].bool()
    return out


def fc_columns(w: torch.Tensor, order: list[int], want: list[int]) -> torch.Tensor:
    """``fc.weight (H, k*H)`` whose column blocks follow layer ids ``order``, reordered to
    ``want``."""
    blocks = w.chunk(len(order), dim=1)
    return torch.cat([blocks[order.index(i)] for i in want], dim=1).contiguous()


def _read_hf(weights: Path, family: DraftFamily, cfg: Any, info: dict, target: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(weights.parent, dtype=torch.float32)


def _read_gguf(weights: Path, family: DraftFamily, cfg: Any, info: dict, target: Any) -> nn.Module:
    """transformers' own GGUF loader (it undoes the q/k RoPE permutation llama.cpp needs), its
    tensors moved into a plain model (a GGUF-loaded one refuses dtype changes). A draft LM only:
    transformers reads no EAGLE-3 or DFlash GGUF."""
    from transformers import AutoModelForCausalLM

    if family.gguf_layout is not None:
        others = " or ".join(f for f in family.export_formats if f != "gguf")
        raise ValueError(f"a {family.name} draft's GGUF is llama.cpp's ({family.gguf_layout} "
                         f"through its converter) and reads back in llama.cpp only; export "
                         f"format={others} to decode it here")
    read = AutoModelForCausalLM.from_pretrained(weights.parent, gguf_file=weights.name,
                                                dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(read.config, dtype=torch.float32)
    model.load_state_dict(read.state_dict())
    return model


def _read_medusa(weights: Path, family: DraftFamily, cfg: Any, info: dict,
                 target: Any) -> nn.Module:
    # the layout stores an LM head per head (a shared one copied): read back as own LM heads
    own = dataclasses.replace(cfg, lm_head="own")
    module = family.empty_head(own, info["target"], None, None)
    module.load_state_dict(medusa_from_reference(load_file(str(weights)), cfg.num_layers))
    return module


def _eagle1_head(state: dict[str, torch.Tensor], family: DraftFamily, cfg: Any, info: dict,
                 target: Any) -> nn.Module:
    """An EAGLE head (layout=eagle1: the engines' structure) from EAGLE-1 tensor names."""
    module = family.empty_head(cfg, info["target"], target_config(info, target),
                               None if target is None else target.model)
    ours = eagle1_to_ours(state, info["target"]["hidden_size"], module.fc.bias is not None)
    module.load_trainable_state_dict({k: v.float() for k, v in ours.items()})
    return module


def _read_eagle(weights: Path, family: DraftFamily, cfg: Any, info: dict,
                target: Any) -> nn.Module:
    return _eagle1_head(load_file(str(weights)), family, cfg, info, target)


def _eagle3_head(state: dict[str, torch.Tensor], fmt: str, family: DraftFamily, cfg: Any,
                 info: dict, target: Any) -> nn.Module:
    module = family.empty_head(cfg, info["target"], target_config(info, target),
                               None if target is None else target.model)
    ours = eagle3_to_ours(state, EAGLE3_LAYER_PREFIX[fmt], list(cfg.fuse_layers))
    module.load_trainable_state_dict({k: (v.float() if v.is_floating_point() else v)
                                      for k, v in ours.items()})
    return module


def _read_eagle3(weights: Path, family: DraftFamily, cfg: Any, info: dict,
                 target: Any) -> nn.Module:
    return _eagle3_head(load_file(str(weights)), "eagle3", family, cfg, info, target)


def _read_speculators(weights: Path, family: DraftFamily, cfg: Any, info: dict,
                      target: Any) -> nn.Module:
    if cfg.layout == "eagle3":  # speculators' eagle3 type
        return _eagle3_head(load_file(str(weights)), "speculators", family, cfg, info, target)
    state = rename_prefix(rename_prefix(load_file(str(weights)), "fusion_fc.", "fc."),
                          "transformer.", "layers.0.")
    return _eagle1_head(state, family, cfg, info, target)


def _read_dflash(weights: Path, family: DraftFamily, cfg: Any, info: dict,
                 target: Any) -> nn.Module:
    """speculators' ``dflash`` tensors carry the drafter's own names; ``fc``'s column blocks go
    from ascending layer order back to ``fuse_layers`` order."""
    module = family.empty_head(cfg, info["target"], target_config(info, target),
                               None if target is None else target.model)
    state = {k: v.float() for k, v in load_file(str(weights)).items()}
    fuse = list(cfg.fuse_layers)
    state["fc.weight"] = fc_columns(state["fc.weight"], sorted(fuse), fuse)
    family.load_state(module, cfg, state)
    return module


def import_export(path: str | Path, target: Any = None, allow_unverified: bool = False,
                  allow_unsigned: bool = False, trusted_keys: Any = None) -> DraftPackage:
    """Load an export made by ``scripts/export.py`` back into draftsmith's heads (round trip).

    The export's signature and manifest are checked as :func:`heads.package.load_package` checks
    a package's (same ``allow_unverified`` / ``allow_unsigned`` / ``trusted_keys``); the signer's
    fingerprint is ``info["signer"]``.

    Raises:
        PackageSignatureError: unsigned, signed by an untrusted key, or the signature does not
            match the files.
        PackageIntegrityError: a file differs from the export's manifest, is unlisted or a link.
        TargetMismatchError: ``target`` is not the target the draft was trained for.
    """
    root = Path(path)
    meta, signer = verify_package(root, allow_unverified, allow_unsigned, trusted_keys)
    fmt, kind = meta["export_format"], meta["draft_kind"]
    if target is not None:
        check_target(meta["target"], target.identity, where=f"{fmt} export")
    family = get_family(kind)
    cfg = family.config_class.from_dict(meta["head_config"])
    info = {"target": meta["target"], "target_config": meta.get("target_config"),
            "signer": signer}
    layout = export_format(fmt)
    module = load_object(layout.reader)(root / layout.weights_file, family, cfg, info, target)
    module.float().eval()
    spec = root / "speculation.json"
    spec_listed = listed(meta, spec.name) and spec.is_file()
    return DraftPackage(family=family, module=module, head_config=cfg,
                        identity=TargetIdentity.from_dict(meta["target"]), path=root,
                        info={**info, "export": meta},
                        speculation=json.loads(spec.read_text()) if spec_listed else None)
