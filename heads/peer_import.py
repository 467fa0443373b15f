"""EAGLE-3 drafts trained by other trainers, read into draftsmith's EAGLE-3 head for decoding.

Three folders are recognised (``draft=FOLDER`` in ``eval/decode.py`` and ``eval/measure.py``):

* **speculators** (0.9.0): a training checkpoint, ``<save_path>/<epoch>/``, as its trainer writes
  it with ``save_pretrained``: ``config.json`` with ``speculators_model_type: eagle3``, the layer
  config under ``transformer_layer_config`` and the flags ``norm_before_residual``,
  ``norm_before_fc``, ``fc_norm``, ``norm_output``, ``embed_requires_grad``; and
  ``model.safetensors`` (bf16 by default) with ``fc``, ``layers.0.*``, ``norm``, ``lm_head``
  (draft rows), ``d2t`` (offsets: target id = draft id + d2t), ``t2d`` (bool) and the verifier's
  ``embed_tokens`` (frozen unless ``embed_requires_grad``). Fused layer ids are transformers'
  ``hidden_states[i]``, concatenated in the listed order.
* **ModelOpt** (0.47.0): an EAGLE-3 export (``LlamaForCausalLMEagle3`` ``config.json`` whose
  ``eagle_config`` carries ModelOpt's ``use_last_layernorm`` / ``use_mtp_layernorm`` flags, and
  ``model.safetensors`` with ``fc``, ``layers.0.*``, ``norm``, ``lm_head``, ``d2t`` offsets, no
  ``t2d``). ModelOpt captures the *output* of each listed layer, i.e. ``hidden_states[i + 1]``.
* **SpecForge** (0.2.0): its SGLang export (``specforge export --to sglang``; its training
  checkpoint, ``{run_id}-step{N}/training_state.pt``, is a pickle of trainer state that this
  export turns into the folder SGLang serves): ``config.json`` with ``architectures:
  [LlamaForCausalLMEagle3]``, the draft config it trained with (``draft_vocab_size``, optional
  ``eagle_config.eagle_aux_hidden_state_layer_ids``, ``fc_norm``, ``norm_output``) and
  ``model.safetensors`` (bf16) with ``fc`` (over exactly 3 layers), ``midlayer.*``, ``norm``,
  ``lm_head`` (draft rows, trained from a random start), ``d2t`` offsets and ``t2d``, no
  embedding (the target's). Layer ids are SGLang's: id i captures the input of layer i + 1, i.e.
  ``hidden_states[i + 1]``, concatenated in layer order; without ids SGLang's default
  ``hidden_states[2, L // 2, L - 3]``.

Such a folder carries no manifest, signature or target identity. It is loaded with a warning that
names the folder, checked against the target (widths, heads, RoPE, norm eps, vocabulary, and the
stored embedding where there is one), and never written back as draftsmith's: signing,
exporting, releasing and quantizing refuse it (``heads/peer_format.py``: ``refuse_peer``). What
the EAGLE-3 head cannot compute exactly (norms before ``fc``, a normed residual, several
layers, a Qwen3-style layer with q/k norms, no output norm, a draft narrower than the target) is
refused by name rather than approximated.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from draftsmith.heads.draft_config import draft_layer_config, rope_parameters
from draftsmith.heads.exports import EAGLE3_LAYER_KEYS
from draftsmith.heads.peer_format import (
    MODELOPT,
    SPECFORGE,
    SPECULATORS,
    PeerCheckpointError,
    peer_config,
    peer_format,
)

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
# layer-config fields the head takes from the target (draft_layer_config), compared one by one
SHAPE_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rms_norm_eps", "vocab_size", "hidden_act")
# speculators' eagle3 flags whose True value changes what the head computes, and why
SPECULATORS_FLAGS = {
    "norm_before_residual": "the residual is the normed hidden state",
    "norm_before_fc": "an RMSNorm over the fused layers before fc",
    "fc_norm": "an RMSNorm per fused layer before fc",
    "norm_output": "post-norm hidden states fed back between steps",
}
# the layer prefix of each format's weights
LAYER_PREFIX = {SPECULATORS: "layers.0.", MODELOPT: "layers.0.", SPECFORGE: "midlayer."}


@dataclass(frozen=True)
class PeerCheckpoint:
    """A peer's EAGLE-3 folder, read: which trainer wrote it, its tensors under draftsmith's
    names and what the head needs to hold them."""

    path: Path
    fmt: str  # speculators | modelopt | specforge
    version: str | None
    fuse_layers: list[int]  # transformers hidden_states ids, in fc's column order
    draft_vocab_size: int
    intermediate_size: int
    ttt_steps: int
    layer_config: dict  # the layer config as the folder states it
    state: dict[str, torch.Tensor]  # draftsmith EAGLE-3 names (d2t as target ids, t2d bool)
    embedding: torch.Tensor | None  # the verifier embedding stored with it (speculators)


def _specforge_problems(cfg: dict) -> list[str]:
    """SpecForge's draft config switches (``LlamaForCausalLMEagle3``) the head does not
    compute."""
    why = []
    if cfg.get("fc_norm"):
        why.append("fc_norm=true (an RMSNorm per fused layer before fc)")
    if cfg.get("norm_output", True) is False:
        why.append("norm_output=false (no output norm before the LM head)")
    if cfg.get("norm_before_residual"):
        why.append("norm_before_residual=true (the residual is the normed hidden state)")
    width = cfg.get("target_hidden_size")
    if width is not None and int(width) != int(cfg.get("hidden_size") or 0):
        why.append(f"target_hidden_size={width} (the head's draft is as wide as the target, "
                   f"hidden_size={cfg.get('hidden_size')})")
    return why


def _problems(cfg: dict, fmt: str) -> list[str]:
    """What the folder's config asks of the head that the EAGLE-3 head does not compute."""
    why = []
    if fmt == SPECULATORS:
        if cfg.get("speculators_model_type") != "eagle3":
            why.append(f"speculators_model_type={cfg.get('speculators_model_type')!r} (only "
                       "'eagle3' reads into the EAGLE-3 head)")
        why += [f"{k}=true ({what})" for k, what in SPECULATORS_FLAGS.items() if cfg.get(k)]
        layer = cfg.get("transformer_layer_config") or {}
    elif fmt == SPECFORGE:
        why += _specforge_problems(cfg)
        layer = cfg
    else:
        eagle = cfg.get("eagle_config") or {}
        if not eagle.get("use_aux_hidden_state", False):
            why.append("eagle_config.use_aux_hidden_state=false (an EAGLE-1 head, no fused "
                       "layers)")
        if not eagle.get("use_last_layernorm", False):
            why.append("eagle_config.use_last_layernorm=false (no output norm before the LM "
                       "head)")
        if eagle.get("use_mtp_layernorm"):
            why.append("eagle_config.use_mtp_layernorm=true")
        if int(eagle.get("parallel_draft_step") or 1) != 1:
            why.append(f"eagle_config.parallel_draft_step={eagle.get('parallel_draft_step')}")
        layer = cfg
    if int(layer.get("num_hidden_layers", 1)) != 1:
        why.append(f"num_hidden_layers={layer.get('num_hidden_layers')} (the head has one layer)")
    if layer.get("model_type", "llama") != "llama":
        why.append(f"a {layer.get('model_type')!r} draft layer (the head's layer is Llama-style)")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        why.append("biases in the draft layer")
    return why


def _layer_ids(cfg: dict, fmt: str, num_layers: int | None) -> list[int]:
    """The fused ``hidden_states`` ids in fc's column order."""
    if fmt == SPECULATORS:
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        if ids is None and num_layers is not None:  # speculators' own default
            ids = [2, num_layers // 2, num_layers - 3]
        return [int(i) for i in ids or []]
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None and fmt == SPECFORGE and num_layers is not None:  # SGLang's own default
        return [2, num_layers // 2, num_layers - 3]
    # ModelOpt hooks the output of layer i; SGLang captures the input of layer i + 1 and
    # concatenates the captured states in layer order, whatever the listed order
    out = [int(i) + 1 for i in ids or []]
    return sorted(out) if fmt == SPECFORGE else out


def _to_ours(state: Mapping[str, torch.Tensor], fmt: str, vocab: int) -> dict[str, torch.Tensor]:
    """The folder's tensors under the head's names: ``layers.0.*`` / ``midlayer.*`` ->
    ``layer.*``; ``d2t`` offsets -> target ids; ``t2d`` from them where the folder has none; a
    full-vocabulary LM head gets the identity map."""
    prefix = LAYER_PREFIX[fmt]
    missing = [k for k in ("fc.weight", "norm.weight", "lm_head.weight",
                           *(f"{prefix}{k}" for k in EAGLE3_LAYER_KEYS)) if k not in state]
    if missing:
        raise PeerCheckpointError(f"the {fmt} checkpoint lacks tensors {missing}")
    bias = state.get("fc.bias")
    if bias is not None and bool(bias.float().abs().max() > 0):
        raise PeerCheckpointError(f"the {fmt} checkpoint has a non-zero fc.bias (the head's fc "
                                  "has none)")
    out = {"fc.weight": state["fc.weight"], "norm.weight": state["norm.weight"],
           "lm_head.weight": state["lm_head.weight"]}
    for key in EAGLE3_LAYER_KEYS:
        out[f"layer.{key}"] = state[f"{prefix}{key}"]
    vd = int(state["lm_head.weight"].shape[0])
    offsets = state.get("d2t")
    if offsets is None:
        if vd != vocab:
            raise PeerCheckpointError(f"the {fmt} checkpoint has an LM head of {vd} rows but no "
                                      f"d2t map to the target's {vocab} ids")
        offsets = torch.zeros(vd, dtype=torch.long)
    d2t = offsets.long() + torch.arange(offsets.numel())
    if d2t.numel() != vd or int(d2t.min()) < 0 or int(d2t.max()) >= vocab:
        raise PeerCheckpointError(f"the {fmt} checkpoint's d2t ({d2t.numel()} ids) does not map "
                                  f"its {vd} LM-head rows into the target's {vocab} ids")
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[d2t] = True
    stored = state.get("t2d")
    if stored is not None and not torch.equal(stored.bool(), t2d):
        raise PeerCheckpointError(f"the {fmt} checkpoint's t2d and d2t disagree")
    out["d2t"], out["t2d"] = d2t, t2d
    return out


def read_peer(path: str | Path, num_target_layers: int | None = None) -> PeerCheckpoint:
    """Read a peer's EAGLE-3 folder (see the module docstring) without a target."""
    root = Path(str(path)).expanduser()
    fmt = peer_format(root)
    if fmt is None:
        raise PeerCheckpointError(f"{root} is not a speculators eagle3 checkpoint, a ModelOpt "
                                  "EAGLE-3 export nor a SpecForge SGLang export (no config.json "
                                  "with speculators_model_type, ModelOpt's eagle_config or "
                                  "architectures [LlamaForCausalLMEagle3])")
    cfg = peer_config(root) or {}
    why = _problems(cfg, fmt)
    if why:
        raise PeerCheckpointError(f"{root}: draftsmith's EAGLE-3 head cannot compute this {fmt} "
                                  "draft exactly:\n  - " + "\n  - ".join(why))
    if not (root / WEIGHTS).is_file():
        raise PeerCheckpointError(f"{root} has no {WEIGHTS}")
    raw = load_file(str(root / WEIGHTS))
    layer = dict(cfg.get("transformer_layer_config") or {}) if fmt == SPECULATORS else dict(cfg)
    vocab = int(layer.get("vocab_size") or 0)
    ids = _layer_ids(cfg, fmt, num_target_layers)
    k = int(raw["fc.weight"].shape[1]) // int(raw["fc.weight"].shape[0]) if "fc.weight" in raw \
        else 0
    if len(ids) < 2 or len(ids) != k:
        raise PeerCheckpointError(f"{root}: {len(ids)} fused layer ids {ids} for an fc over {k} "
                                  "layers")
    if fmt == SPECULATORS:
        methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
        steps = int(methods[0].get("speculative_tokens") or 3)
        version = cfg.get("speculators_version")
    else:
        steps, version = 3, None
    state = _to_ours(raw, fmt, vocab)
    gate = raw[f"{LAYER_PREFIX[fmt]}mlp.gate_proj.weight"]
    return PeerCheckpoint(path=root, fmt=fmt, version=version, fuse_layers=ids,
                          draft_vocab_size=int(state["lm_head.weight"].shape[0]),
                          intermediate_size=int(gate.shape[0]),
                          ttt_steps=steps, layer_config=layer, state=state,
                          embedding=raw.get("embed_tokens.weight"))


def shape_mismatches(layer_config: Mapping[str, Any], target_config: Any) -> list[str]:
    """Where the folder's draft layer differs from the layer the head derives from the target
    (the head takes its shape, RoPE and norm eps from the target)."""
    ours = draft_layer_config(target_config)
    theirs = draft_layer_config({**dict(layer_config), "num_hidden_layers": 1})
    why = [f"{key}={getattr(theirs, key)!r}, the target's {getattr(ours, key)!r}"
           for key in SHAPE_KEYS if getattr(theirs, key) != getattr(ours, key)]
    a, b = rope_parameters(theirs), rope_parameters(ours)
    if {k: a.get(k) for k in b} != b:
        why.append(f"RoPE {a}, the target's {b}")
    return why


def peer_as_draft(path: str | Path, target: Any) -> Any:
    """The peer's folder as an EAGLE-3 ``DraftPackage`` for the loaded ``target`` (nothing
    written), with a warning naming the folder.

    Raises:
        PeerCheckpointError: not a peer folder the head reads exactly, or made for another
            target (shape, vocabulary, or a stored embedding that is not the target's).
    """
    from draftsmith.heads.eagle_config import EagleConfig
    from draftsmith.heads.family import get_family
    from draftsmith.heads.package import DraftPackage

    tcfg = target.model.config
    peer = read_peer(path, int(tcfg.num_hidden_layers))
    why = shape_mismatches(peer.layer_config, tcfg)
    bad_ids = [i for i in peer.fuse_layers if not 0 <= i < int(tcfg.num_hidden_layers)]
    if bad_ids:
        why.append(f"fused layer ids {bad_ids} (the target's layers are 0..."
                   f"{int(tcfg.num_hidden_layers) - 1} before its final norm)")
    emb = target.model.get_input_embeddings().weight
    if peer.embedding is not None and (peer.embedding.shape != emb.shape or not torch.allclose(
            peer.embedding.float(), emb.detach().float().cpu(), rtol=1e-2, atol=1e-2)):
        why.append("its stored embedding is not the target's (trained for another target, or "
                   "with embed_requires_grad)")
    if why:
        raise PeerCheckpointError(f"{peer.path} ({peer.fmt}) was not made for the target "
                                  f"{target.identity.name}:\n  - " + "\n  - ".join(why))
    log.warning("draft=%s is a %s checkpoint%s, not a draftsmith package: an unsigned import "
                "(no manifest, signature or target record), read into the EAGLE-3 head and "
                "checked against the target's shapes%s; it is never written back as draftsmith's",
                peer.path, peer.fmt, f" (speculators {peer.version})" if peer.version else "",
                " and embedding" if peer.embedding is not None else "")
    types = peer.layer_config.get("layer_types") or []
    if "sliding_attention" in types:
        window = peer.layer_config.get("sliding_window")
        log.warning("%s: its draft layer attends over a sliding window of %s tokens; the head "
                    "attends over the whole context, so drafts past that many tokens of context "
                    "can differ from the trainer's (decoding stays lossless)", peer.path, window)
    family = get_family("eagle")
    cfg = EagleConfig(draft_vocab_size=peer.draft_vocab_size, fuse_layers=list(peer.fuse_layers),
                      ttt_steps=peer.ttt_steps, layout="eagle3",
                      intermediate_size=peer.intermediate_size)
    module = family.empty_head(cfg, target.identity.to_dict(), tcfg, target.model)
    module.load_trainable_state_dict({k: (v.float() if v.is_floating_point() else v)
                                      for k, v in peer.state.items()})
    info = {"draft_kind": "eagle", "foreign": str(peer.path), "peer": peer.fmt,
            "peer_version": peer.version, "target": target.identity.to_dict()}
    return DraftPackage(family=family, module=module.float().eval(), head_config=cfg,
                        identity=target.identity, speculation=None, path=peer.path, info=info)
