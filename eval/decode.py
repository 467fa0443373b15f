"""Decode a prompt set with a draft package through the speculative decoder.

    python eval/decode.py draft=DIR prompts=humaneval limit=8 max_new_tokens=128 temperature=0 \
        out=run.json

``draft=`` takes a draft package or a folder written by ``scripts/export.py`` (hf / eagle /
speculators / medusa layouts); ``draft=none`` decodes plainly, ``draft=lookup`` uses prompt
lookup, ``draft=suffix`` the suffix proposer (:mod:`eval.decoding.proposers_suffix`); with a
package, ``suffix=true`` (the default) drafts each round from the package, the suffix match or
both, whichever the measured rates favour (``batch_size > 1``: each row's chain from the package
or its suffix match; batched trees from the package alone; ``draft=lookup`` at batch size one
only, ``draft=suffix`` being its batched alternative). ``k=null`` starts from the K* that
``eval/measure.py`` wrote into the package's ``speculation.json`` (else 4); the summary's
``k_source`` says which. Plain decoding of the same
prompts runs in the same process (``baseline=true``), interleaved per prompt (plain,
speculative, plain), and gives the ``speedup``: the median of the per-prompt ratios, with
``speedup_spread`` (their min and max) and ``noisy`` (the plain repeats of more than a quarter of
the prompts differ by more than ``noise_tolerance``); ``draft=none`` measures plain against plain
(~1.0x: a check of the measurement). The JSON has a ``summary`` (the
:class:`~eval.decoding.stats.DecodeStats` fields plus ``speedup``, ``k``, ``k_source``,
``draft_kind``, ``lossless``, ``device``, ``dtype``) and ``samples`` (one per prompt: ``id``,
``category``, ``prompt_ids``, ``output_ids``, ``output_text``, ``tau``, ...).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import hydra
from omegaconf import DictConfig

from draftsmith.data.dtype import resolve_dtype
from draftsmith.data.packaged import PKG_PREFIX
from draftsmith.data.prompts import check_prompt_set
from draftsmith.eval import CONF_DIR, session
from draftsmith.eval.checks import (
    check_noise_tolerance,
    check_out_file,
    check_sampling,
    integer,
    number,
)
from draftsmith.eval.decoding.batch_drafters import batch_drafter_for
from draftsmith.eval.decoding.kernels import check_draft_kernels, check_kernels, kernels_in
from draftsmith.eval.decoding.proposers import PlainProposer, PromptLookupProposer, Proposer
from draftsmith.eval.decoding.proposers_suffix import SuffixProposer
from draftsmith.eval.decoding.shadow import Shadow
from draftsmith.eval.decoding.slots import check_layout
from draftsmith.eval.decoding.tree import check_tree_draw
from draftsmith.eval.draft import (
    TreeMode,
    build_proposer,
    load_draft,
    parse_draft_vocab,
    record_at,
    resolve_k,
    settle,
)
from draftsmith.eval.retime import check_retime, measured_here, replan

CONF_FILE = CONF_DIR / "decode.yaml"
NO_DRAFT = ("none", "null", "")
DTYPES = ("float32", "bfloat16", "float16")


def baseline_proposer(draft: Any) -> Proposer | None:
    """The draft-free proposer that ``draft=`` names (``none`` = plain decoding, ``lookup`` =
    prompt lookup, ``suffix`` = the suffix proposer), or None when ``draft`` is a folder."""
    name = "none" if draft is None else str(draft)
    if name.lower() in NO_DRAFT:
        return PlainProposer()
    if name == "lookup":
        return PromptLookupProposer()
    if name == "suffix":
        return SuffixProposer()
    return None


def validate(cfg: DictConfig) -> None:
    """Every setting and ``out``, before any model is loaded (measure.py and bench.py reuse the
    sampling, prompt and draft checks)."""
    TreeMode.parse(cfg.tree)
    check_tree_draw(cfg.get("tree_draw", "sample"))
    if cfg.dtype not in (*DTYPES, "auto"):
        raise ValueError(f"dtype={cfg.dtype!r}: allowed {(*DTYPES, 'auto')}")
    if integer("max_new_tokens", cfg.max_new_tokens, "an integer >= 1") < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.limit is not None and integer("limit", cfg.limit, "an integer >= 1 or null") < 1:
        raise ValueError(f"limit must be >= 1 or null, got {cfg.limit}")
    parse_draft_vocab(cfg.get("draft_vocab"))
    if cfg.k is not None and integer("k", cfg.k, "an integer >= 0 or null") < 0:
        raise ValueError(f"k must be >= 0 or null (K* from speculation.json), got {cfg.k}")
    check_noise_tolerance(cfg.get("noise_tolerance"))
    check_sampling(cfg.temperature, cfg.top_k, cfg.top_p)
    budget = cfg.get("time_budget_s")
    if budget is not None and number("time_budget_s", budget, "seconds > 0 or null") <= 0:
        raise ValueError(f"time_budget_s must be > 0 or null (no budget), got {budget}")
    check_prompt_set(cfg.prompts)
    batch = integer("batch_size", cfg.get("batch_size", 1), "an integer >= 1")
    if batch < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch}")
    if batch > 1 and str(cfg.tree) == "tree" and str(cfg.get("batch_layout")) == "packed":
        raise ValueError("batched trees use batch_layout=padded (each row its own tree mask); "
                         "use batch_layout=padded or tree=chain")
    if batch > 1 and cfg.get("time_budget_s") is not None:
        raise ValueError("time_budget_s is per request: batch_size > 1 does not take it")
    check_layout(str(cfg.get("batch_layout", "padded")), "batch_layout")
    base = baseline_proposer(cfg.draft)
    if batch > 1 and base is not None:
        batch_drafter_for(base)  # prompt lookup has none: its error names draft=suffix
    if cfg.get("compile_draft", False) not in (True, False):
        raise ValueError(f"compile_draft={cfg.get('compile_draft')!r}: allowed false or true "
                         "(torch.compile the EAGLE head's step)")
    if cfg.get("fused_draft", True) not in (True, False):
        raise ValueError(f"fused_draft={cfg.get('fused_draft')!r}: allowed true (the EAGLE "
                         "head's layer as plain tensor ops) or false (its transformers modules)")
    check_retime(cfg.get("retime", "auto"))
    check_kernels(cfg.get("kernels", "auto"))
    check_draft_kernels(cfg.get("draft_kernels", "auto"))
    if cfg.get("suffix", True) not in (True, False):
        raise ValueError(f"suffix={cfg.get('suffix')!r}: allowed true (a package drafts beside "
                         "the suffix proposer, per round by measured rates) or false")
    if cfg.get("shadow", True) not in (True, False):
        raise ValueError(f"shadow={cfg.get('shadow')!r}: allowed true (a re-timed draft is "
                         "judged on these prompts: shadow chains beside plain steps, verified "
                         "rounds while it drafts) or false")
    if (base is None and not str(cfg.draft).startswith(PKG_PREFIX)
            and not Path(str(cfg.draft)).expanduser().is_dir()):
        raise ValueError(f"draft={cfg.draft}: no such folder, so not a draft package; pass a "
                         "draft package or export folder, a model sharing the target's "
                         "vocabulary (pkg:<key> or a folder), none (plain decoding), lookup "
                         "(prompt lookup) or suffix (the suffix proposer)")
    check_out_file("out", cfg.get("out"), {"prompts": cfg.prompts, "draft": cfg.draft})


def run(cfg: DictConfig, loaded: Any = None) -> dict:
    """Decode the prompt set; returns the JSON dict (also written to ``cfg.out``).

    Args:
        cfg: the decode config (``conf/eval/decode.yaml`` keys).
        loaded: an already loaded ``LoadedTarget`` (else loaded from ``cfg.target_path``).
    """
    validate(cfg)
    batch_size = int(cfg.get("batch_size") or 1)
    cfg.dtype = resolve_dtype(cfg.dtype, str(cfg.device))  # auto: the faster one measured here
    loaded = session.open_target(cfg, loaded)
    model, tok = loaded.model, loaded.tokenizer
    records = session.prompt_records(cfg.prompts, tok, cfg.limit)
    proposer, k, k_source, shadow = make_proposer(cfg, loaded, records)
    sampling = session.Sampling.from_config(cfg)
    eos = session.eos_ids(model)
    tolerance = float(cfg.get("noise_tolerance", session.NOISE_TOLERANCE))
    if batch_size > 1:
        dec, res = _decode_batches(cfg, model, proposer, k, records, sampling, eos, tolerance)
    else:
        dec = decoder_for(cfg, model, proposer, k, records, shadow)
        # plain with baseline=true: plain against plain through the same paired path (~1.0x:
        # a check of the measurement itself); plain without a baseline is 1.0x by definition
        res = session.paired(dec, model, records, sampling, eos, baseline=bool(cfg.baseline),
                             noise_tolerance=tolerance)
    summary = summarize(cfg, res, proposer, dec, k, k_source, batch_size)
    samples = res.samples
    for s in samples:
        s["output_text"] = tok.decode(s["output_ids"], skip_special_tokens=True)
    result = {"summary": summary, "samples": samples}
    if cfg.out:
        out = Path(str(cfg.out)).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    return result


def decoder_for(cfg: Mapping[str, Any], model: Any, proposer: Proposer, k: int,
                records: list[dict], shadow: Shadow | None = None) -> Any:
    """The batch-1 speculative decoder of ``proposer`` as ``cfg`` sets it (K controller, fallback,
    acceptance rule), warmed up on ``records`` (:func:`eval.session.decoder`), then given
    ``shadow`` (the warm-up's two tokens do not count)."""
    dec = session.decoder(model, proposer, records, k=k, k_max=cfg.k_max,
                          adaptive=bool(cfg.adaptive_k), fallback=bool(cfg.fallback),
                          acceptance=cfg.acceptance)
    dec.shadow = shadow
    return dec


def summarize(cfg: Mapping[str, Any], res: Any, proposer: Proposer, dec: Any, k: int,
              k_source: str, batch_size: int = 1) -> dict[str, Any]:
    """The JSON ``summary`` of a paired run ``res`` (:class:`~eval.session.Paired`) of
    ``proposer`` through ``dec`` (:func:`run`; eval/compare.py, one per draft)."""
    plain = proposer.name == "plain"
    stats = res.stats
    measured = res.baseline_tokens_per_s is not None
    base_tps = res.baseline_tokens_per_s if measured or not plain else stats.tokens_per_s
    spread = res.speedup_spread
    return {**stats.to_dict(),
            "speedup": res.speedup if measured else (1.0 if plain else None),
            "speedup_spread": list(spread) if spread else None, "noisy": res.noisy,
            "noise_tolerance": res.noise_tolerance,
            "noisy_prompts": res.noisy_prompts if measured else None,
            "baseline_tokens_per_s": base_tps, "matches_baseline": res.matches_baseline,
            "k": k, "k_source": k_source,
            "tree": proposer.tree,
            "tree_size": getattr(proposer, "total_tokens", None) if proposer.tree else None,
            "tree_draw": (getattr(proposer, "tree_draw", None)
                          if proposer.tree and float(cfg.temperature) > 0 else None),
            "draft_vocab": getattr(proposer, "draft_vocab", None),
            "draft_kind": proposer.name,
            # beside the suffix proposer: the rounds drafted from the suffix match, the
            # package or both (batched: one per row and round; None: the package alone, or no
            # package)
            "suffix_rounds": (dict(proposer.choices) if isinstance(proposer, SuffixProposer)
                              and proposer.inner is not None else None),
            # the draft judged on these prompts (shadow chains beside plain steps, verified
            # rounds): what was measured, when drafting started or stopped
            "shadow": None if getattr(dec, "shadow", None) is None else dec.shadow.report(),
            "draft": None if plain else str(cfg.draft), "lossless": dec.lossless,
            "device": str(dec.target.device), "dtype": cfg.dtype,
            "kernels": kernels_in(dec.target.model),
            "temperature": float(cfg.temperature), "top_k": int(cfg.top_k),
            "top_p": float(cfg.top_p), "prompts": str(cfg.prompts), "limit": cfg.limit,
            "max_new_tokens": int(cfg.max_new_tokens), "n_samples": len(res.samples),
            "batch_size": batch_size}


class Drafting(NamedTuple):
    """What :func:`make_proposer` settles: the proposer, its initial K, where K came from, and
    the judge of a draft re-timed to plain decoding or a chain (:mod:`eval.decoding.shadow`;
    None: none), which :func:`decoder_for` hands to the decoder. Re-timed to plain decoding, a
    hybrid starts with its package paused: suffix chains where they beat a plain step, shadow
    chains of the package beside the plain steps."""

    proposer: Proposer
    k: int
    k_source: str
    shadow: Shadow | None = None


def make_proposer(cfg: DictConfig, loaded: Any, records: list[dict] | None = None) -> Drafting:
    """The proposer ``cfg.draft`` names, its initial K and where K came from (the target
    ``loaded`` already in ``cfg.dtype`` on ``cfg.device``). Given ``records``, a record measured
    on another machine or dtype is re-timed on the first prompt (``retime``, :mod:`eval.retime`)."""
    proposer = baseline_proposer(cfg.draft)
    shadow = None
    if proposer is None:
        pkg = load_draft(cfg.draft, loaded)
        plan = settle(cfg, pkg)
        if records:
            plan, shadow = retimed(cfg, pkg, plan, loaded, records[0]["prompt_ids"])
        vocab = int(loaded.model.config.vocab_size)
        proposer = build_proposer(pkg, plan, loaded, vocab, cfg.device, cfg.dtype,
                                  cfg.get("draft_kernels", "auto"))
        if cfg.get("compile_draft", False):
            if not hasattr(proposer, "compile"):
                raise ValueError(f"compile_draft=true applies to EAGLE heads, not to a "
                                 f"{pkg.family.name} draft; use compile_draft=false")
            proposer.compile()
        if not cfg.get("fused_draft", True) and getattr(proposer, "step", None) is not None:
            proposer.step = None  # the head's transformers modules
        k, source = plan.k, plan.k_source
        # batched trees draft the package's tree alone (batched rows draft chains of one kind
        # each: the suffix match's or the package's, eval/decoding/batch_suffix.py)
        if (cfg.get("suffix", True) and (plan.k > 0 or shadow is not None)
                and (int(cfg.get("batch_size") or 1) == 1 or not proposer.tree)):
            proposer = SuffixProposer(proposer, vocab)
            if k == 0 and proposer.pause(True):  # the package waits for the shadow's verdict
                k, source = shadow.depth, source + "; suffix chains meanwhile"
        return Drafting(proposer, k, source, shadow)
    if proposer.name == "plain":
        return Drafting(proposer, 0, "plain")
    return Drafting(proposer, *resolve_k(cfg.k, None))


def retimed(cfg: DictConfig, pkg: Any, plan: Any, loaded: Any,
            prompt_ids: list[int]) -> tuple[Any, Shadow | None]:
    """``plan``, or the plan :func:`eval.retime.replan` chooses with this machine's costs: with
    ``retime=auto`` when the record was measured on another machine or dtype, ``true`` always;
    never where ``k`` or ``tree_size`` was given, at ``batch_size > 1`` or without a record.
    With it, the shadow drafting of a plan re-timed to plain decoding (None: none)."""
    mode = check_retime(cfg.get("retime", "auto"))
    record, _ = record_at(pkg.speculation, float(cfg.temperature or 0.0))
    if (mode == "false" or plan.k == 0 or cfg.get("k") is not None
            or cfg.get("tree_size") is not None or int(cfg.get("batch_size") or 1) > 1
            or not isinstance(record.get("k_star"), int) or not record.get("alpha")):
        return plan, None
    if mode == "auto" and measured_here(record, str(cfg.dtype), str(cfg.device),
                                        kernels_in(loaded.model)):
        return plan, None
    plan, shapes, shadow = replan(cfg, pkg, plan, loaded, prompt_ids, record)
    shown = ", ".join(f"{s.nodes or 'chain'}/{s.k}: {s.speedup:.2f}x" for s in shapes[:4])
    print(f"{plan.k_source} [shape/depth: predicted speedup: {shown}]")
    return plan, shadow


def _decode_batches(cfg: DictConfig, model: Any, proposer: Proposer, k: int, records: list,
                    sampling: Any, eos: Any, tolerance: float) -> tuple[Any, Any]:
    """``batch_size > 1``: :class:`~eval.decoding.batch.BatchDecoder` (fixed K, per-row
    fallback) and plain batched decoding, paired per batch (:func:`eval.session.paired_batches`).
    """
    from draftsmith.eval.decoding.batch import BatchDecoder

    if cfg.acceptance != "lossless":
        raise ValueError("batch_size > 1 verifies losslessly: use acceptance=lossless")
    dec = BatchDecoder(model, proposer, k=k, fallback=bool(cfg.fallback),
                       layout=str(cfg.get("batch_layout", "padded")))
    plain = BatchDecoder(model, PlainProposer(), k=0) if cfg.baseline else None
    for d in (dec, plain) if plain is not None else (dec,):  # warm-up
        d.generate([records[0]["prompt_ids"]], 2, seed=0)
    return dec, session.paired_batches(dec, plain, records, sampling, eos, int(cfg.batch_size),
                                       tolerance)


def print_summary(summary: Mapping[str, Any]) -> None:
    """A short rich table of the headline numbers."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"draft={summary.get('draft') or 'none'} ({summary['draft_kind']})")
    for col in ("k (source)", "tokens", "tau", "accept", "tok/s", "speedup", "lossless"):
        table.add_column(col, justify="right")
    sp, spread = summary.get("speedup"), summary.get("speedup_spread")
    speedup = "-" if sp is None else f"{sp:.2f}x"
    if spread:
        speedup += f" ({spread[0]:.2f}-{spread[1]:.2f})"
    if summary.get("noisy"):
        speedup += " noisy"
    table.add_row(f"{summary['k']} ({summary.get('k_source', '-')})",
                  str(summary["tokens_generated"]), f"{summary['tau']:.2f}",
                  f"{summary['acceptance_rate']:.2f}", f"{summary['tokens_per_s']:.1f}",
                  speedup, str(summary["lossless"]))
    console = Console()
    console.print(table)
    judged = summary.get("shadow") or {}
    for turn in judged.get("switches") or ():
        said = ("started drafting it" if turn["to"] == "draft"
                else "stopped drafting (suffix chains alone, or plain steps)")
        console.print(f"judged on these prompts after {turn['chains']} shadow chains and "
                      f"{turn['rounds']} verified rounds, alpha {turn['alpha']}: chain K = "
                      f"{turn['k']} predicted {turn['predicted']:.2f}x, {said}")
    verdict = judged.get("verdict")
    if verdict and not verdict["switched"]:
        console.print(f"last verdict: {verdict['chains']} shadow chains, {verdict['rounds']} "
                      f"verified rounds, alpha {verdict['alpha']}: chain K = {verdict['k']} "
                      f"predicted {verdict['predicted']:.2f}x, unchanged")
    if summary.get("noisy"):
        console.print(f"noisy: the plain runs of {summary.get('noisy_prompts')} prompts differ by "
                      f"more than {summary.get('noise_tolerance', 0.1):.0%}; the machine's speed "
                      "changed while measuring, so the speedup is not to be trusted")


def run_overrides(overrides: list[str]) -> dict:
    """Run with Hydra override strings in-process (used by sweeps)."""
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra.compose(config_name="decode", overrides=list(overrides))
    return run(cfg)


@hydra.main(config_path=str(CONF_DIR), config_name="decode", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Command line: decode, then print the summary table."""
    print_summary(run(cfg)["summary"])


if __name__ == "__main__":
    main()
