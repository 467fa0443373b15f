"""The EAGLE head's options (:class:`EagleConfig`) and the choices derived from the target:
the head's one-layer Llama config, the fused layers and the draft vocabulary size behind
``auto`` (``heads/eagle.py`` builds the head from them)."""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers import LlamaConfig

from draftsmith.heads.blocks import HeadConfig
from draftsmith.heads.draft_config import draft_layer_config

log = logging.getLogger(__name__)

EAGLE_LAYOUTS = ("eagle1", "normed", "eagle3")
LM_HEAD_STARTS = ("copy", "frozen", "random")


@dataclass
class EagleConfig(HeadConfig):
    """EAGLE head options.

    Attributes:
        draft_vocab_size: None = the target's vocabulary with its frozen LM head; an int selects
            that many most frequent target ids (``build_vocab_map``) and a trainable LM head.
        fuse_layers: None = input is the final hidden state; else ids into
            ``out.hidden_states`` (0 = embeddings .. num_layers) fused as the input (k = len).
        ttt_steps: training-time-test unrolling depth (draft positions trained per sample).
        feature_noise: half-width a of uniform noise U(-a, a) added to the target features in
            training (0 disables).
        init_layer: None = fresh decoder layer; an int copies that target layer's weights.
        intermediate_size: the draft layer's MLP width; None = the target's (engines read it
            from the exported config, so a narrower MLP costs less drafting time and storage).
        layout: ``"eagle1"`` = the EAGLE-1 engine layout (no fc bias, no input norm on the
            layer, no output norm; exportable); ``"normed"`` = fc bias, input norm and a
            trainable output RMSNorm (not exportable); ``"eagle3"`` = the EAGLE-3 engine layout
            (needs >= 2 fuse_layers). See the module docstring.
        lm_head: the reduced-vocabulary LM head's start: ``"copy"`` = the target's rows for the
            draft vocabulary, trained; ``"frozen"`` = those rows, not trained; ``"random"`` =
            ``nn.Linear``'s default initialisation, trained. A full-vocabulary head is always
            the target's, frozen (``"copy"`` or ``"frozen"``).
    """

    draft_vocab_size: int | None = None
    fuse_layers: list[int] | None = None
    ttt_steps: int = 1
    feature_noise: float = 0.0
    init_layer: int | None = None
    layout: str = "eagle1"
    intermediate_size: int | None = None
    lm_head: str = "copy"

    def __post_init__(self) -> None:
        if self.lm_head not in LM_HEAD_STARTS:
            raise ValueError(f"EagleConfig.lm_head must be one of {LM_HEAD_STARTS}, got "
                             f"{self.lm_head!r}")
        if self.lm_head == "random" and self.draft_vocab_size is None:
            raise ValueError("EagleConfig.lm_head=random trains a new LM head over a reduced "
                             "vocabulary: set draft.config.draft_vocab_size, or use "
                             "draft.config.lm_head=copy for the target's frozen head")
        if self.layout not in EAGLE_LAYOUTS:
            raise ValueError(f"EagleConfig.layout must be one of {EAGLE_LAYOUTS}, got "
                             f"{self.layout!r} (set draft.config.layout=eagle1 for a head "
                             "serving engines can load)")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"EagleConfig.draft_vocab_size must be None or >= 1, "
                             f"got {self.draft_vocab_size}")
        if self.fuse_layers is not None:
            self.fuse_layers = [int(i) for i in self.fuse_layers]
            if not self.fuse_layers:
                raise ValueError("EagleConfig.fuse_layers must be None or a non-empty list of "
                                 "layer ids")
        if self.ttt_steps < 1:
            raise ValueError(f"EagleConfig.ttt_steps must be >= 1, got {self.ttt_steps}")
        if self.feature_noise < 0:
            raise ValueError(f"EagleConfig.feature_noise must be >= 0, got {self.feature_noise}")
        if self.intermediate_size is not None and int(self.intermediate_size) < 1:
            raise ValueError("EagleConfig.intermediate_size must be None (the target's) or >= 1, "
                             f"got {self.intermediate_size}")
        if self.layout == "eagle3":
            if self.fuse_layers is None or len(self.fuse_layers) < 2:
                raise ValueError("EagleConfig.layout=eagle3 fuses several target layers: set "
                                 "draft.config.fuse_layers to >= 2 layer ids, e.g. [2, 15, 27] "
                                 f"(got {self.fuse_layers})")
            if self.init_layer is not None:
                raise ValueError("EagleConfig.init_layer cannot seed an eagle3 layer (its "
                                 "attention reads width 2H, the target's layers width H); set "
                                 "draft.config.init_layer=null")

    @property
    def num_fused(self) -> int:
        return 1 if self.fuse_layers is None else len(self.fuse_layers)


def head_llama_config(target_config: Any, intermediate_size: int | None = None) -> LlamaConfig:
    """The head's one-layer Llama config, derived from the target's (any architecture), with
    the MLP width ``intermediate_size`` (None: the target's)."""
    cfg = draft_layer_config(target_config, num_layers=1)
    if intermediate_size is not None:
        cfg.intermediate_size = int(intermediate_size)
    return cfg


def auto_fuse_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high hidden-state ids for a target of ``num_layers`` layers:
    ``[2, L // 2, L - 3]`` (30 layers: 2, 15, 27; 18 layers: 2, 9, 15)."""
    if num_layers < 6:
        return sorted({1, max(1, num_layers // 2), max(1, num_layers - 1)})
    return [2, num_layers // 2, num_layers - 3]


AUTO_DRAFT_VOCAB = 32768  # EAGLE-3's reduced vocabulary for Llama 3's 128k-id vocabulary


def resolve_fuse_layers(raw: Mapping[str, Any], target_config: Any) -> dict[str, Any]:
    """``draft.config`` with ``fuse_layers: auto`` replaced by EAGLE-3's low / middle / high
    hidden-state ids of the target (:func:`auto_fuse_layers`), the choice logged."""
    raw = dict(raw)
    if raw.get("fuse_layers") == "auto":
        from draftsmith.heads.draft_config import text_config

        n = int(text_config(target_config).num_hidden_layers)
        raw["fuse_layers"] = auto_fuse_layers(n)
        log.info("draft.config.fuse_layers=auto -> %s (low / middle / high of %d layers)",
                 raw["fuse_layers"], n)
    return raw


def auto_draft_vocab_size(vocab_size: int) -> int | None:
    """``draft_vocab_size: auto``: the target's own vocabulary (None) up to
    :data:`AUTO_DRAFT_VOCAB` ids, else that many of the training data's most frequent ids
    (SmolLM2's 49,152: 32,768; Gemma 3's 262,144: 32,768, an eighth of its LM-head rows)."""
    return None if vocab_size <= AUTO_DRAFT_VOCAB else AUTO_DRAFT_VOCAB
