"""An evaluation session: one target, its prompts, and paired plain / speculative decoding.

``decode.py``, ``measure.py``, ``exactness.py``, ``scripts/bench.py`` and the transformers peers
all decode through this module: :func:`open_target` loads and places the target,
:func:`prompt_records` encodes a prompt set through its chat template, :func:`decoder` builds the
speculative decoder (warmed up), :func:`decode_set` decodes every prompt, and :func:`paired`
decodes the same prompts plainly in the same process, the only fair baseline for a speedup.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eval.decoder import SpeculativeDecoder
from eval.proposers import PlainProposer, Proposer
from eval.stats import DecodeStats


@dataclass(frozen=True)
class Sampling:
    """How each prompt is decoded (the decode config's sampling keys)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    time_budget_s: float | None = None

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> Sampling:
        return cls(int(cfg["max_new_tokens"]), float(cfg.get("temperature", 0.0)),
                   int(cfg.get("top_k", 0)), float(cfg.get("top_p", 1.0)),
                   int(cfg.get("seed", 0)), cfg.get("time_budget_s"))


def open_target(cfg: Mapping[str, Any], loaded: Any = None) -> Any:
    """The ``LoadedTarget`` of ``cfg.target_path`` (or the packaged default) in ``cfg.dtype`` on
    ``cfg.device``, eval mode; ``loaded`` (already loaded) is moved there instead."""
    from data.target import load_target

    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))
    dtype = getattr(torch, cfg["dtype"])
    if loaded is None:
        loaded = load_target(cfg.get("target_path") or cfg.get("target") or None, dtype=dtype)
    loaded.model.to(device=cfg["device"], dtype=dtype).eval()
    return loaded


def eos_ids(model: torch.nn.Module) -> Any:
    """The model's EOS id(s) from its generation config (None without one)."""
    return model.generation_config.eos_token_id if model.generation_config else None


# ----------------------------------------------------------------------------- prompts
def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """One user turn through the chat template, with the assistant's generation prompt."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the target's tokenizer has no chat template: prompts are chat turns "
                         "and need one (save the tokenizer with its chat_template)")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def prompt_records(prompts: str, tokenizer: Any, limit: int | None = None) -> list[dict]:
    """Prompts as ``{"id", "category", "prompt_ids"}`` dicts.

    Args:
        prompts: ``humaneval`` | ``sharegpt`` | a FastChat ``question.jsonl`` path
            (see :func:`data.prompts.load_prompts`).
        tokenizer: the target's tokenizer (chat template included).
        limit: keep the first ``limit`` prompts.

    Raises:
        ValueError: no tokenizer, or no prompt loaded.
    """
    from data.prompts import load_prompts

    if tokenizer is None:
        raise ValueError("the target has no tokenizer: prompts cannot be encoded")
    items = load_prompts(str(prompts), limit=None if limit is None else int(limit))
    records = [{"id": p.id, "category": p.category,
                "prompt_ids": encode_prompt(tokenizer, p.turns[0])} for p in items]
    if not records:
        raise ValueError(f"no prompts loaded from prompts={prompts!r} (limit={limit})")
    return records


# ----------------------------------------------------------------------------- decoding
def decoder(model: torch.nn.Module, proposer: Proposer, records: Sequence[dict] = (),
            **options: Any) -> SpeculativeDecoder:
    """A speculative decoder of ``model`` with ``proposer`` (``options``: ``k``, ``k_max``,
    ``adaptive``, ``fallback``, ``acceptance``), warmed up on the first record if given
    (allocations, kernels), so that the first timed prompt is not the slow one."""
    dec = SpeculativeDecoder(model, proposer, **options)
    if records:
        dec.generate(records[0]["prompt_ids"], 2, seed=0)
    return dec


def plain_decoder(model: torch.nn.Module, records: Sequence[dict] = ()) -> SpeculativeDecoder:
    """Plain decoding (one target forward per token) through the same decoder."""
    return decoder(model, PlainProposer(), records, k=0)


def decode_set(dec: SpeculativeDecoder, records: Sequence[dict], sampling: Sampling,
               eos: Any) -> tuple[list[dict], DecodeStats]:
    """Decode every record (seed ``sampling.seed + index``); per-sample dicts and merged stats."""
    samples, parts = [], []
    for i, rec in enumerate(records):
        res = dec.generate(rec["prompt_ids"], sampling.max_new_tokens, sampling.temperature,
                           sampling.top_k, sampling.top_p, eos_token_id=eos,
                           time_budget_s=sampling.time_budget_s, seed=sampling.seed + i)
        parts.append(res.stats)
        samples.append({**rec, "output_ids": res.output_ids, "tau": res.stats.tau,
                        "target_forwards": res.stats.target_forwards,
                        "wall_time_s": res.stats.wall_time_s})
    return samples, DecodeStats.merge(parts)


@dataclass
class Paired:
    """Speculative decoding and plain decoding of the same prompts in the same process."""

    samples: list[dict]
    stats: DecodeStats
    baseline_tokens_per_s: float | None
    matches_baseline: float | None  # greedy only: the fraction of token-identical outputs

    @property
    def speedup(self) -> float | None:
        base = self.baseline_tokens_per_s
        return self.stats.tokens_per_s / base if base else None


def paired(dec: SpeculativeDecoder, model: torch.nn.Module, records: Sequence[dict],
           sampling: Sampling, eos: Any, baseline: bool = True) -> Paired:
    """Decode ``records`` with ``dec``, then (``baseline``) plainly; at T = 0 lossless means
    token-identical, so the fraction of identical outputs is recorded."""
    samples, stats = decode_set(dec, records, sampling, eos)
    if not baseline:
        return Paired(samples, stats, None, None)
    base_samples, base = decode_set(plain_decoder(model), records, sampling, eos)
    matches = None
    if sampling.temperature == 0.0:
        same = [a["output_ids"] == b["output_ids"] for a, b in zip(samples, base_samples)]
        matches = sum(same) / len(same)
    return Paired(samples, stats, base.tokens_per_s, matches)
