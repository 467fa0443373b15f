"""Draft family 1: a small causal LM sharing the target's vocabulary and tokenizer.

The draft is a transformers causal LM of the target's own architecture (a ``LlamaForCausalLM``
for a Llama target, a ``Gemma3ForCausalLM`` for Gemma 3, ...) with fewer layers, built from a
config derived from the target's (``heads.draft_config.draft_model_config``), so that target layers
can seed it, it saves with ``save_pretrained``, loads with ``AutoModelForCausalLM`` and can serve
as a transformers ``assistant_model``; the package names its class (``config.json``'s
``architectures``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from draftsmith.heads.blocks import (
    DistillTarget,
    HeadConfig,
    master_dtype,
    pack_rows,
    shifted_labels,
    teacher_mask,
    teacher_rows,
)
from draftsmith.heads.draft_config import draft_model_config, text_config

try:  # transformers >= 5
    from transformers.initialization import no_init_weights
except ImportError:  # 4.x
    from transformers.modeling_utils import no_init_weights

INIT_CHOICES = ("random", "target", "model")  # model: another model's weights (heads/foreign.py)


@dataclass
class DraftLMConfig(HeadConfig):
    """Size and initialisation of a draft LM.

    Attributes:
        num_layers: decoder layers in the draft.
        hidden_size: residual width; must equal the target's for ``init="target"``.
        intermediate_size: MLP width.
        num_heads: attention heads.
        num_kv_heads: key/value heads (grouped-query attention).
        init: ``"random"`` (fresh weights), ``"target"`` (copy embeddings, the layers in
            ``init_layers``, final norm and LM head from the target; sizes must match) or
            ``"model"`` (a whole model sharing the target's vocabulary: ``draft.init_from``).
        init_layers: target layer indices copied into draft layers 0..num_layers-1 when
            ``init="target"``; empty means evenly spaced from the first to the last layer.
        head_dim: attention head width; None = the target's when the widths are the target's,
            else ``hidden_size // num_heads``.
    """

    num_layers: int = 2
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_heads: int = 9
    num_kv_heads: int = 3
    init: str = "target"
    init_layers: list[int] = field(default_factory=list)
    head_dim: int | None = None

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"DraftLMConfig.{key} must be >= 1, got {getattr(self, key)}")
        if self.init not in INIT_CHOICES:
            raise ValueError(f"DraftLMConfig.init must be one of {INIT_CHOICES}, got {self.init!r}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"DraftLMConfig.hidden_size ({self.hidden_size}) must be divisible "
                             f"by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"DraftLMConfig.num_heads ({self.num_heads}) must be divisible by "
                             f"num_kv_heads ({self.num_kv_heads})")
        self.init_layers = [int(i) for i in (self.init_layers or [])]
        if self.init_layers and len(self.init_layers) != self.num_layers:
            raise ValueError(f"DraftLMConfig.init_layers has {len(self.init_layers)} entries but "
                             f"num_layers is {self.num_layers}; give one target layer per draft "
                             "layer or leave it empty for evenly spaced layers")

    @classmethod
    def matching(cls, target_config: Any, num_layers: int, **kw: Any) -> DraftLMConfig:
        """A config with the target's widths and ``num_layers`` layers (so target init works)."""
        tc = text_config(target_config)
        heads = tc.num_attention_heads
        kw.setdefault("head_dim", getattr(tc, "head_dim", None) or tc.hidden_size // heads)
        return cls(num_layers=num_layers, hidden_size=tc.hidden_size,
                   intermediate_size=tc.intermediate_size, num_heads=heads,
                   num_kv_heads=getattr(tc, "num_key_value_heads", None) or heads, **kw)


def default_init_layers(num_draft: int, num_target: int) -> list[int]:
    """Evenly spaced target layer ids from the first to the last (e.g. 2 of 30 -> [0, 29])."""
    if num_draft == 1:
        return [num_target - 1]
    return [round(i * (num_target - 1) / (num_draft - 1)) for i in range(num_draft)]


def draft_lm_config(cfg: DraftLMConfig, target_config: Any) -> PretrainedConfig:
    """The draft's model config: the target's class, vocabulary, RoPE and special ids, draft
    sizes, and the layer types of the target layers it copies."""
    tc = text_config(target_config)
    layers = cfg.init_layers or default_init_layers(cfg.num_layers, tc.num_hidden_layers)
    return draft_model_config(tc, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size,
                              cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                              source_layers=layers if cfg.init == "target" else ())


def _check_target_init(cfg: DraftLMConfig, tc: PretrainedConfig) -> list[int]:
    pairs = {"hidden_size": (cfg.hidden_size, tc.hidden_size),
             "intermediate_size": (cfg.intermediate_size, tc.intermediate_size),
             "num_heads": (cfg.num_heads, tc.num_attention_heads),
             "num_kv_heads": (cfg.num_kv_heads, tc.num_key_value_heads),
             "head_dim": (cfg.head_dim or cfg.hidden_size // cfg.num_heads,
                          getattr(tc, "head_dim", None)
                          or tc.hidden_size // tc.num_attention_heads)}
    bad = [f"{k}: draft {a} vs target {b}" for k, (a, b) in pairs.items() if a != b]
    if bad:
        raise ValueError("init='target' copies weights and needs matching sizes, but "
                         + "; ".join(bad) + ". Use DraftLMConfig.matching(target_config, n) or "
                         "init='random'.")
    layers = cfg.init_layers or default_init_layers(cfg.num_layers, tc.num_hidden_layers)
    out_of_range = [i for i in layers if not 0 <= i < tc.num_hidden_layers]
    if out_of_range:
        raise ValueError(f"init_layers {out_of_range} are outside the target's "
                         f"{tc.num_hidden_layers} layers (valid ids 0..{tc.num_hidden_layers - 1})")
    return layers


def build_draft_lm(cfg: DraftLMConfig, target_model: PreTrainedModel) -> PreTrainedModel:
    """Build a draft LM for ``target_model`` (same vocabulary, tokenizer and special ids).

    Args:
        cfg: draft sizes and init choice.
        target_model: the target causal LM (only read).

    Returns:
        A causal LM of the target's class in the target's dtype (fp32 for a 16-bit
        target), in train mode.

    Raises:
        ValueError: ``init="target"`` with sizes that differ from the target's, or bad layer ids.
    """
    tc = text_config(target_model.config)
    dcfg = draft_lm_config(cfg, tc)
    dtype = master_dtype(next(target_model.parameters()).dtype)
    if cfg.init != "target":
        draft = AutoModelForCausalLM.from_config(dcfg).to(dtype)
    else:
        layers = _check_target_init(cfg, tc)
        # every weight is copied from the target below: random init first would only cost time
        # (about 16 s for a copy of Qwen2.5-Coder-0.5B on one core)
        with no_init_weights():  # which also skips tying the LM head to the embedding
            draft = AutoModelForCausalLM.from_config(dcfg).to(dtype)
        draft.tie_weights()
        with torch.no_grad():
            src, dst = target_model.model, draft.model
            dst.get_input_embeddings().weight.copy_(src.get_input_embeddings().weight)
            for j, i in enumerate(layers):
                dst.layers[j].load_state_dict(src.layers[i].state_dict())
            dst.norm.load_state_dict(src.norm.state_dict())
            if not dcfg.tie_word_embeddings:
                draft.lm_head.weight.copy_(target_model.lm_head.weight)
        copied = [dst.get_input_embeddings(), *dst.layers, dst.norm,
                  *(() if dcfg.tie_word_embeddings else (draft.lm_head,))]
        written = {id(p) for module in copied for p in module.parameters()}
        unset = [n for n, p in draft.named_parameters() if id(p) not in written]
        if unset:  # the architecture holds weights this copy does not know about
            raise ValueError(f"init='target' copies the embedding, {len(layers)} layers, the "
                             f"final norm and the LM head, but the draft also has {unset[:5]}: "
                             "use init='random' for this target's architecture")
    if getattr(target_model, "generation_config", None) is not None:
        draft.generation_config = copy.deepcopy(target_model.generation_config)
    return draft.train()


def apply_lora(model: PreTrainedModel, r: int = 8, alpha: float = 16.0,
               target_modules: list[str] | None = None, dropout: float = 0.0) -> nn.Module:
    """Wrap the draft in LoRA adapters (peft); only the adapters train.

    Args:
        model: the draft LM.
        r: adapter rank (>= 1).
        alpha: LoRA scaling numerator (effective scale alpha / r).
        target_modules: module names to adapt; default all attention and MLP projections.
        dropout: dropout on the adapter input.

    Returns:
        A ``peft.PeftModel``; call ``.merge_and_unload()`` to get the plain causal LM.
    """
    from peft import LoraConfig, get_peft_model

    if r < 1:
        raise ValueError(f"LoRA rank r must be >= 1, got {r}")
    modules = target_modules or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                 "down_proj"]
    lcfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=modules, lora_dropout=dropout,
                      bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, lcfg)


def distill_targets(draft: nn.Module, input_ids: Tensor, hidden: Tensor, loss_mask: Tensor,
                    attention_mask: Tensor | None = None) -> list[DistillTarget]:
    """Teacher-forced training pairs for the draft LM (one draft position, k=1), packed.

    Alignment: draft logits at position t (having read tokens <= t) predict token t+1 and are
    compared with the teacher ``p_t`` from ``hidden[:, t]``; counted iff token t+1 is a
    non-padding token with ``loss_mask`` set. Only the N counted entries are returned, in
    (b, t) order, shaped (1, N, ...) (``pack_rows``): the LM head runs on those rows only.

    Args:
        draft: the draft LM (or its peft wrapper).
        input_ids: (B, T) token ids.
        hidden: (B, T, H) target final hidden states.
        loss_mask: (B, T) bool, tokens to learn to predict.
        attention_mask: (B, T) 0/1 padding mask or None.

    Returns:
        ``[DistillTarget(logits (1,N,V), teacher_hidden (1,N,H), mask (1,N) all True,
        labels (1,N), teacher_index (1,N))]``.
    """
    mask = teacher_mask(loss_mask, attention_mask, 0)
    labels = shifted_labels(input_ids, 0)
    index = teacher_rows(*input_ids.shape, 0, input_ids.device)
    # The decoder stack on every position, the LM head on the counted rows only (a LoRA wrapper
    # forwards get_decoder / get_output_embeddings to the wrapped model, adapters included).
    states = draft.get_decoder()(input_ids=input_ids, attention_mask=attention_mask
                                 ).last_hidden_state  # (B, T, H_draft)
    rows, teacher, labels, index, mask = pack_rows(mask, states, hidden, labels, index)
    return [DistillTarget(draft.get_output_embeddings()(rows), teacher, mask, labels,
                          teacher_index=index)]
