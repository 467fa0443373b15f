"""An evaluation session: one target, its prompts, and paired plain / speculative decoding.

``decode.py``, ``measure.py``, ``exactness.py``, ``scripts/bench.py`` and the transformers peers
all decode through this module: :func:`open_target` loads and places the target,
:func:`prompt_records` encodes a prompt set through its chat template, :func:`decoder` builds the
speculative decoder (warmed up), :func:`decode_set` decodes every prompt, and :func:`paired`
decodes the same prompts plainly in the same process, interleaved per prompt (plain,
speculative, plain), the only fair baseline for a speedup: its ``speedup`` is the paired speedup
of :mod:`eval.speedup` over the prompts, and ``noisy`` says when the machine's speed changed
under a prompt.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from draftsmith.eval.decoding.decoder import SpeculativeDecoder
from draftsmith.eval.decoding.proposers import PlainProposer, Proposer
from draftsmith.eval.decoding.stats import DecodeStats
from draftsmith.eval.speedup import PairedSpeedup, paired_speedup


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
    """The ``LoadedTarget`` of ``cfg.target_path`` in ``cfg.dtype`` on ``cfg.device``, eval mode;
    ``loaded`` (already loaded) is moved there instead. ``target_path`` null: the packaged
    target ``cfg.draft`` was made for (conf/target/*.yaml, found by its digest), else the
    packaged default. Its chat format is ``cfg.chat_template`` when the config has the key (as
    ``target.chat_template`` in training: null = the tokenizer's own, or the plain format for a
    base model)."""
    from draftsmith.data.packaged import draft_target_path
    from draftsmith.data.target import load_target

    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))
    dtype = getattr(torch, cfg["dtype"])
    if loaded is None:
        path = cfg.get("target_path") or cfg.get("target")
        if not path and cfg.get("draft"):
            path = draft_target_path(cfg["draft"])
        loaded = load_target(path or None, dtype=dtype, chat_template=cfg.get("chat_template"))
    from draftsmith.eval.decoding.kernels import apply_kernels, kernels_in

    if kernels_in(loaded.model) == "packed":  # packed once, for this dtype and device
        if loaded.model.dtype != dtype:
            raise ValueError(f"the target's linears are packed for {loaded.model.dtype}, not "
                             f"{dtype}: load it again for another dtype")
        return loaded
    loaded.model.to(device=cfg["device"], dtype=dtype).eval()
    loaded.kernels = str(cfg.get("kernels", "auto"))
    used, why = apply_kernels(loaded.model, loaded.kernels)
    print(f"target kernels: {used} ({why})")
    return loaded


def eos_ids(model: torch.nn.Module) -> Any:
    """The model's EOS id(s) from its generation config (None without one)."""
    return model.generation_config.eos_token_id if model.generation_config else None


# ----------------------------------------------------------------------------- prompts
def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """One user turn through the chat template, with the assistant's generation prompt."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the target's tokenizer has no chat template: prompts are chat turns "
                         "and need one (load the target with data.target.load_target, which "
                         "gives a base model the plain format, or save the tokenizer with its "
                         "chat_template)")
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
    from draftsmith.data.prompts import load_prompts

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


def decode_one(dec: SpeculativeDecoder, rec: dict, index: int, sampling: Sampling,
               eos: Any) -> tuple[dict, DecodeStats]:
    """Decode one record (seed ``sampling.seed + index``); its sample dict and stats."""
    res = dec.generate(rec["prompt_ids"], sampling.max_new_tokens, sampling.temperature,
                       sampling.top_k, sampling.top_p, eos_token_id=eos,
                       time_budget_s=sampling.time_budget_s, seed=sampling.seed + index)
    return {**rec, "output_ids": res.output_ids, "tau": res.stats.tau,
            "target_forwards": res.stats.target_forwards,
            "wall_time_s": res.stats.wall_time_s}, res.stats


def decode_set(dec: SpeculativeDecoder, records: Sequence[dict], sampling: Sampling,
               eos: Any) -> tuple[list[dict], DecodeStats]:
    """Decode every record (seed ``sampling.seed + index``); per-sample dicts and merged stats."""
    samples, parts = [], []
    for i, rec in enumerate(records):
        sample, st = decode_one(dec, rec, i, sampling, eos)
        samples.append(sample)
        parts.append(st)
    return samples, DecodeStats.merge(parts)


NOISE_TOLERANCE = 0.1  # default: plain repeats of a prompt may differ by 10% of their mean
NOISY_SHARE = 0.25  # noisy: more than a quarter of the prompts had plain repeats that far apart


@dataclass
class Paired:
    """Speculative decoding and plain decoding of the same prompts in the same process.

    Each prompt is decoded plainly, speculatively, then plainly again (same seed), so whatever
    the machine does meanwhile hits both sides of that prompt's ratio alike.

    Attributes:
        samples: the speculative samples (with ``plain_wall_time_s`` and ``speedup`` per prompt
            when there is a baseline).
        stats: the merged speculative stats.
        baseline_tokens_per_s: plain tokens/s over all plain runs of every prompt.
        matches_baseline: greedy only: the fraction of outputs token-identical to plain's.
        pairing: the paired speedup over the prompts (None without a baseline).
        noise_tolerance: the largest ``plain_drift`` of a quiet prompt.
    """

    samples: list[dict]
    stats: DecodeStats
    baseline_tokens_per_s: float | None
    matches_baseline: float | None
    pairing: PairedSpeedup | None = None
    noise_tolerance: float = NOISE_TOLERANCE

    @property
    def ratios(self) -> list[float]:
        """Per prompt, speculative tokens/s over the median of its plain tokens/s (with two
        plain runs, their mean)."""
        return self.pairing.ratios if self.pairing else []

    @property
    def plain_drift(self) -> list[float]:
        """Per prompt, the range of its plain tokens/s over their median (with two runs a and
        b: ``|a - b| / mean(a, b)``)."""
        return self.pairing.base_drift if self.pairing else []

    @property
    def speedup(self) -> float | None:
        """The median of the per-prompt ratios (None without a baseline)."""
        return self.pairing.median if self.pairing else None

    @property
    def speedup_spread(self) -> tuple[float, float] | None:
        """``(min, max)`` of the per-prompt ratios."""
        return self.pairing.spread if self.pairing else None

    @property
    def noisy_prompts(self) -> int:
        """Prompts whose two plain runs differ by more than ``noise_tolerance``."""
        return sum(d > self.noise_tolerance for d in self.plain_drift)

    @property
    def noisy(self) -> bool | None:
        """True when more than :data:`NOISY_SHARE` of the prompts are noisy: the machine's speed
        changed within single prompts, so the speedup is not to be trusted (None: no baseline)."""
        if not self.plain_drift:
            return None
        return self.noisy_prompts > NOISY_SHARE * len(self.plain_drift)


def _tps(stats: DecodeStats) -> float:
    return stats.tokens_generated / stats.wall_time_s if stats.wall_time_s > 0 else 0.0


def paired(dec: SpeculativeDecoder, model: torch.nn.Module | None, records: Sequence[dict],
           sampling: Sampling, eos: Any, baseline: bool = True,
           noise_tolerance: float = NOISE_TOLERANCE,
           plain: SpeculativeDecoder | None = None) -> Paired:
    """Decode ``records`` with ``dec``; with ``baseline``, each prompt plainly before and after
    (interleaved, see :class:`Paired`). At T = 0 lossless means token-identical, so the fraction
    of identical outputs is recorded.

    Args:
        dec: the (warmed-up) speculative decoder.
        model: the target, for the plain decoder (warmed up here) unless ``plain`` is given.
        records: prompt records (:func:`prompt_records`).
        sampling: how each prompt is decoded.
        eos: EOS id(s).
        baseline: also decode plainly (else no speedup).
        noise_tolerance: see :attr:`Paired.noisy`.
        plain: the plain decoder to compare with (default: :func:`plain_decoder` of ``model``).

    Raises:
        ValueError: ``noise_tolerance`` is negative.
    """
    if not baseline:
        _check_tolerance(noise_tolerance)
        samples, stats = decode_set(dec, records, sampling, eos)
        return Paired(samples, stats, None, None, noise_tolerance=float(noise_tolerance))
    return paired_many([dec], model, records, sampling, eos, noise_tolerance, plain)[0]


def _check_tolerance(noise_tolerance: float) -> None:
    if not float(noise_tolerance) >= 0:
        raise ValueError(f"noise_tolerance must be >= 0 (a fraction of the plain tokens/s), "
                         f"got {noise_tolerance}")


def paired_many(decs: Sequence[SpeculativeDecoder], model: torch.nn.Module | None,
                records: Sequence[dict], sampling: Sampling, eos: Any,
                noise_tolerance: float = NOISE_TOLERANCE,
                plain: SpeculativeDecoder | None = None, rounds: int = 1) -> list[Paired]:
    """:func:`paired` for several decoders at once (a grid of K or tree shapes; a draft at a
    fixed K beside decode.py's defaults): per prompt, ``rounds`` times plain decoding then every
    decoder in turn, and plain decoding once more at the end. Each decoder's ratio for the prompt
    is the median of its runs' tokens/s over the median of the prompt's plain runs (one round:
    over the mean of the two). One :class:`Paired` per decoder, sharing the plain runs; its
    samples are the first round's, its stats merge every round.

    Raises:
        ValueError: ``noise_tolerance`` is negative or ``rounds`` below 1.
    """
    _check_tolerance(noise_tolerance)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if plain is None:
        plain = plain_decoder(model, records)
    n = len(decs)
    samples: list[list[dict]] = [[] for _ in range(n)]
    parts: list[list[DecodeStats]] = [[] for _ in range(n)]
    tps: list[list[list[float]]] = [[] for _ in range(n)]  # decoder -> prompt -> its runs
    same: list[list[bool]] = [[] for _ in range(n)]
    plain_parts, plain_tps = [], []
    for i, rec in enumerate(records):
        plain_runs, runs = [], [[] for _ in range(n)]
        for _ in range(rounds):
            plain_runs.append(decode_one(plain, rec, i, sampling, eos))
            for j, dec in enumerate(decs):
                runs[j].append(decode_one(dec, rec, i, sampling, eos))
        plain_runs.append(decode_one(plain, rec, i, sampling, eos))
        plain_parts += [st for _, st in plain_runs]
        plain_tps.append([_tps(st) for _, st in plain_runs])
        for j, dec_runs in enumerate(runs):
            sample = dec_runs[0][0]
            tps[j].append([_tps(st) for _, st in dec_runs])
            parts[j] += [st for _, st in dec_runs]
            same[j].append(sample["output_ids"] == plain_runs[0][0]["output_ids"])
            samples[j].append({**sample,
                               "plain_wall_time_s": [st.wall_time_s for _, st in plain_runs],
                               "plain_tokens": [st.tokens_generated for _, st in plain_runs]})
    baseline_tps = DecodeStats.merge(plain_parts).tokens_per_s
    greedy = sampling.temperature == 0.0 and bool(records)
    out = []
    for j in range(n):
        pairing = paired_speedup(tps[j], plain_tps)
        for sample, ratio in zip(samples[j], pairing.per_unit):
            sample["speedup"] = ratio
        out.append(Paired(samples[j], DecodeStats.merge(parts[j]), baseline_tps,
                          sum(same[j]) / len(same[j]) if greedy else None, pairing,
                          float(noise_tolerance)))
    return out


# ----------------------------------------------------------------------------- batches
def paired_batches(dec: Any, plain: Any | None, records: Sequence[dict], sampling: Sampling,
                   eos: Any, batch_size: int,
                   noise_tolerance: float = NOISE_TOLERANCE) -> Paired:
    """:func:`paired` for :class:`~eval.decoding.batch.BatchDecoder`: the records in batches of
    ``batch_size`` (in order); per batch, plain batched decoding, ``dec``, plain again (one
    generator per batch, seeded ``sampling.seed + first index``). A batch's ratio is its
    tokens/s (all rows, over the batch's wall time) over the mean of its two plain runs; every
    sample of the batch carries it, and ``speedup`` is the median over batches. ``plain``
    None: no baseline (no ratios). A row's own stats time it from the batch's start to the
    step it finished in, so their ``tokens_per_s`` is a row's rate, not the batch's."""
    _check_tolerance(noise_tolerance)
    samples, parts, plain_parts, same = [], [], [], []
    tps, plain_tps, batch_rows = [], [], []

    def run(d: Any, batch: Sequence[dict], seed: int) -> tuple[list, float]:
        t0 = time.perf_counter()
        res = d.generate([r["prompt_ids"] for r in batch], sampling.max_new_tokens,
                         sampling.temperature, sampling.top_k, sampling.top_p,
                         eos_token_id=eos, seed=seed)
        wall = time.perf_counter() - t0
        return res, sum(len(r.output_ids) for r in res) / wall if wall > 0 else 0.0

    for start in range(0, len(records), batch_size):
        batch = records[start:start + batch_size]
        seed = sampling.seed + start
        before, a = run(plain, batch, seed) if plain is not None else (None, 0.0)
        res, batch_tps = run(dec, batch, seed)
        parts += [r.stats for r in res]
        rows = [{**rec, "output_ids": r.output_ids, "tau": r.stats.tau,
                 "target_forwards": r.stats.target_forwards, "wall_time_s": r.stats.wall_time_s,
                 "batch": start // batch_size} for rec, r in zip(batch, res)]
        if plain is None:
            samples += rows
            continue
        after, b = run(plain, batch, seed)
        tps.append(batch_tps)
        plain_tps.append([a, b])
        plain_parts += [r.stats for r in before + after]
        for row, r, pb, pa in zip(rows, res, before, after):
            same.append(r.output_ids == pb.output_ids)
            samples.append({**row, "plain_wall_time_s": [pb.stats.wall_time_s,
                                                         pa.stats.wall_time_s],
                            "plain_tokens": [pb.stats.tokens_generated,
                                             pa.stats.tokens_generated]})
        batch_rows.append(len(rows))
    if plain is None:
        return Paired(samples, DecodeStats.merge(parts), None, None,
                      noise_tolerance=float(noise_tolerance))
    pairing = paired_speedup(tps, plain_tps)
    ratios = [ratio for ratio, n in zip(pairing.per_unit, batch_rows) for _ in range(n)]
    for sample, ratio in zip(samples, ratios):
        sample["speedup"] = ratio
    greedy = sampling.temperature == 0.0 and bool(records)
    return Paired(samples, DecodeStats.merge(parts), DecodeStats.merge(plain_parts).tokens_per_s,
                  sum(same) / len(same) if greedy else None, pairing, float(noise_tolerance))
