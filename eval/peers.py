"""Transformers peers for sweeps: ``generate``, assisted generation, prompt lookup.

Each peer decodes the same prompts as ``eval/decode.py`` and returns the decoder's JSON
shape (``{"summary": {...}, "samples": [...]}``), timed the same way: wall time of the
generation calls only (model loading and one short warm-up excluded), tokens/s = new
tokens / that time. Target forwards are counted with a forward hook on the target, so
``tau`` = new tokens / target forwards (the prefill forward counts, as it yields a token).
The ``speedup`` of assisted generation and prompt lookup is against transformers'
plain ``generate`` on the same prompts in the same run; for ``hf_generate`` it is 1.

Methods (``settings["method"]``):
- ``hf_generate``: ``model.generate`` without a draft.
- ``hf_assisted``: ``assistant_model`` = the draft LM package (kind ``lm``),
  ``num_assistant_tokens=k``, ``num_assistant_tokens_schedule`` = ``schedule`` (set on the
  assistant's ``generation_config``, where transformers reads them); with
  ``constant`` the draft-confidence early stop is off (``assistant_confidence_threshold=0``)
  so that K really is fixed, ``heuristic`` keeps transformers' defaults.
- ``hf_prompt_lookup``: ``prompt_lookup_num_tokens=k``.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel
from typing_extensions import Self

PEER_METHODS = ("hf_generate", "hf_assisted", "hf_prompt_lookup")


class _ForwardCounter:
    """Counts forward calls of a module while registered (a ``with`` block)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.count, self._h = module, 0, None

    def _hook(self, *_: Any) -> None:
        self.count += 1

    def __enter__(self) -> Self:
        self._h = self.module.register_forward_hook(self._hook)
        return self

    def __exit__(self, *_: object) -> None:
        self._h.remove()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generation_kwargs(method: str, temperature: float, max_new_tokens: int,
                      k: int | None, schedule: str | None, top_k: int | None = None,
                      top_p: float | None = None, pad_token_id: int | None = None) -> dict:
    """Keyword arguments of ``model.generate`` for one peer (assistant model excluded).

    Raises:
        ValueError: unknown method, or a peer that needs ``k`` without it.
    """
    if method not in PEER_METHODS:
        raise ValueError(f"method={method!r} is not a transformers peer: use one of {PEER_METHODS}")
    kw: dict[str, Any] = {"max_new_tokens": int(max_new_tokens), "pad_token_id": pad_token_id}
    if temperature > 0:
        kw.update(do_sample=True, temperature=float(temperature), top_k=top_k or 0,
                  top_p=top_p if top_p is not None else 1.0)
    else:
        kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    if method != "hf_generate" and not k:
        raise ValueError(f"method={method} needs k= (draft tokens per step), got {k!r}")
    if method == "hf_prompt_lookup":
        kw.update(prompt_lookup_num_tokens=int(k))
    return kw


def assistant_settings(k: int, schedule: str | None) -> dict:
    """Settings transformers reads from the *assistant's* ``generation_config``.

    ``constant`` turns off the draft-confidence early stop so that K really is fixed.
    """
    schedule = schedule or "constant"
    if schedule not in ("constant", "heuristic"):
        raise ValueError(f"schedule={schedule!r}: use constant or heuristic")
    out = {"num_assistant_tokens": int(k), "num_assistant_tokens_schedule": schedule}
    if schedule == "constant":
        out["assistant_confidence_threshold"] = 0.0
    return out


def _decode_all(model: PreTrainedModel, prompts: Sequence[Mapping], gen_kw: dict,
                assistant: PreTrainedModel | None, seed: int, tokenizer: Any = None
                ) -> tuple[list[dict], float, int]:
    """Generate for every prompt; returns (samples, generation seconds, target forwards)."""
    device = next(model.parameters()).device
    samples, wall, forwards = [], 0.0, 0
    extra = {"assistant_model": assistant} if assistant is not None else {}
    for i, p in enumerate(prompts):
        ids = torch.tensor([list(p["prompt_ids"])], device=device)
        torch.manual_seed(seed + i)
        with _ForwardCounter(model) as counter, torch.inference_mode():
            _sync(device)
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **gen_kw, **extra)
            _sync(device)
            dt = time.perf_counter() - t0
        new = out[0, ids.shape[1]:].tolist()
        wall += dt
        forwards += counter.count
        text = tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else None
        samples.append({"id": p.get("id", i), "category": p.get("category"),
                        "prompt_ids": list(p["prompt_ids"]), "output_ids": new,
                        "output_text": text,
                        "tau": len(new) / counter.count if counter.count else None,
                        "target_forwards": counter.count, "wall_time_s": dt})
    return samples, wall, forwards


def run_peer_on(model: PreTrainedModel, prompts: Sequence[Mapping], method: str, *,
                temperature: float = 0.0, max_new_tokens: int = 64, k: int | None = None,
                schedule: str | None = None, assistant: PreTrainedModel | None = None,
                top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                tokenizer: Any = None, baseline: bool = True, warmup: bool = True) -> dict:
    """Run one transformers peer on already-tokenized prompts.

    Args:
        model: the target causal LM (eval mode).
        prompts: dicts with ``prompt_ids`` (list of ints), optional ``id`` and ``category``.
        method: one of :data:`PEER_METHODS`.
        assistant: the draft LM for ``hf_assisted``.
        baseline: also time plain ``generate`` for the speedup (peers other than hf_generate).
        warmup: one 2-token generate before timing.

    Returns:
        ``{"summary": {...}, "samples": [...]}`` in the decoder's format.

    Raises:
        ValueError: ``hf_assisted`` without an assistant, or an empty prompt list.
    """
    if not prompts:
        raise ValueError("no prompts to decode: check prompts= and limit=")
    if method == "hf_assisted" and assistant is None:
        raise ValueError("method=hf_assisted needs a draft LM (draft=DIR of a kind 'lm' package)")
    pad = (model.config.pad_token_id if model.config.pad_token_id is not None
           else model.config.eos_token_id)
    gen_kw = generation_kwargs(method, temperature, max_new_tokens, k, schedule, top_k, top_p, pad)
    if assistant is not None:
        for key, val in assistant_settings(k, schedule).items():
            setattr(assistant.generation_config, key, val)
    if warmup:
        warm = {**gen_kw, "max_new_tokens": 2}
        _decode_all(model, prompts[:1], warm, assistant, seed)
    samples, wall, forwards = _decode_all(model, prompts, gen_kw, assistant, seed, tokenizer)
    tokens = sum(len(s["output_ids"]) for s in samples)
    tps = tokens / wall if wall > 0 else None
    speedup, base_tps = (1.0, tps) if method == "hf_generate" else (None, None)
    if baseline and method != "hf_generate":
        plain_kw = generation_kwargs("hf_generate", temperature, max_new_tokens, None, None,
                                     top_k, top_p, pad)
        b_samples, b_wall, _ = _decode_all(model, prompts, plain_kw, None, seed)
        base_tps = sum(len(s["output_ids"]) for s in b_samples) / b_wall if b_wall > 0 else None
        speedup = tps / base_tps if tps and base_tps else None
    summary = {
        "tokens_generated": tokens, "target_forwards": forwards,
        "tau": tokens / forwards if forwards else None, "acceptance_rate": None,
        "alpha": [], "alpha_cumulative": [], "draft_time_s": None, "verify_time_s": None,
        "wall_time_s": wall, "tokens_per_s": tps, "speedup": speedup,
        "baseline_tokens_per_s": base_tps, "k": k, "draft_kind": method, "schedule": schedule,
        "lossless": None, "device": str(next(model.parameters()).device),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "temperature": temperature,
    }
    return {"summary": summary, "samples": samples}


def load_assistant(draft: str | Path, loaded: Any, dtype: torch.dtype,
                   device: torch.device) -> PreTrainedModel:
    """A draft package (or export) whose module is a whole transformers causal LM, verified
    against its manifest and the target ``loaded``, as transformers' ``assistant_model``.

    Raises:
        ValueError: the draft's family cannot assist ``generate`` (Medusa / EAGLE heads).
    """
    from draftsmith.eval.draft import load_draft

    pkg = load_draft(draft, loaded)
    if not pkg.family.hf_model:
        raise ValueError(f"transformers assisted generation needs a draft LM package, {draft} is "
                         f"draft_kind={pkg.family.name!r}: use method=spec for medusa/eagle drafts")
    return pkg.module.to(device=device, dtype=dtype).eval()


def run_peer(settings: Mapping[str, Any]) -> dict:
    """Load the target (and the draft LM) named by sweep settings and run the peer."""
    from draftsmith.data.target import load_target
    from draftsmith.eval.session import prompt_records

    dtype = getattr(torch, settings.get("dtype") or "float32")
    device = torch.device(settings.get("device") or "cpu")
    target = load_target(settings.get("target"), dtype=dtype)
    model = target.model.to(device).eval()
    prompts = prompt_records(settings.get("prompts"), target.tokenizer, settings.get("limit"))
    assistant = (load_assistant(settings["draft"], target, dtype, device)
                 if settings["method"] == "hf_assisted" else None)
    out = run_peer_on(model, prompts, settings["method"],
                      temperature=float(settings.get("temperature") or 0.0),
                      max_new_tokens=int(settings.get("max_new_tokens") or 64),
                      k=settings.get("k"), schedule=settings.get("schedule"), assistant=assistant,
                      top_k=settings.get("top_k"), top_p=settings.get("top_p"),
                      seed=int(settings.get("seed") or 0), tokenizer=target.tokenizer)
    out["summary"].update(draft=settings.get("draft"), prompts=settings.get("prompts"))
    return out
