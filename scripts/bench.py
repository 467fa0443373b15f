"""Benchmark every decoding method and every draft family on the real target, in one run.

    python scripts/bench.py lm=DIR medusa=DIR eagle=DIR          # `make bench ARGS="lm=..."`

On MT-bench questions (first turns, chat template with a generation prompt), at each temperature
of ``temperatures``: plain decoding (ours), transformers ``generate``, ``generate`` with
``assistant_model`` = the draft LM at the same K, ``prompt_lookup_num_tokens`` at that K, and our
decoder with the draft LM (chain at K*, and its dynamic tree when ``eval/measure.py`` found one
that pays), Medusa (static tree) and EAGLE (chain at K*, and the dynamic tree) for the packages
given; assisted generation also runs at the draft LM tree's depth, so ours is compared with it at
the same K. A missing package is skipped with a printed note. Training and feature-caching
throughput are measured by ``scripts/bench_train.py`` (``make bench`` runs both).

Per method the tables give medians over prompts of tokens/s, and ratios measured in this run
(per prompt: method tokens/s over plain decoding's tokens/s on the same prompt; median over
prompts: the paired speedup of :mod:`eval.speedup`). The fallback bound of decode.py's defaults
is :mod:`scripts.bench_fallback`. ``bench/results.json`` holds everything, ``bench/results.md``
the tables, with the hardware, versions, date and command.
"""
from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.data.attention import native_gqa
from draftsmith.data.dtype import resolve_dtype
from draftsmith.data.prompts import check_prompt_set
from draftsmith.eval import decode, session
from draftsmith.eval.checks import check_out_dir, check_sampling, integer
from draftsmith.eval.draft import Measured, load_draft
from draftsmith.eval.machine import environment
from draftsmith.eval.markdown import table, write_markdown
from draftsmith.eval.speedup import paired_speedup
from draftsmith.heads.family import FAMILIES
from draftsmith.heads.family_base import TreeKind
from draftsmith.heads.vocab import FULL
from draftsmith.scripts.bench_drafts import draft_paths, measured_tree, package_k, speculation_of
from draftsmith.scripts.bench_fallback import bench_fallback, fallback_markdown
from draftsmith.scripts.tooling import note, repo_path

CONF_FILE = decode.CONF_DIR / "bench.yaml"
TOOL = "bench"  # the tag of its progress lines


# ----------------------------------------------------------------------------- rows
def per_prompt_tps(samples: list[dict]) -> list[float]:
    """Tokens/s of each sample (new tokens over its generation wall time)."""
    return [len(s["output_ids"]) / s["wall_time_s"] if s["wall_time_s"] else 0.0 for s in samples]


def speedup_over(samples: list[dict], base: list[dict]) -> float | None:
    """The paired speedup of ``samples`` over ``base``, decoded from the same prompts."""
    return paired_speedup(per_prompt_tps(samples), per_prompt_tps(base)).median


def row(method: str, result: dict, temperature: float, plain: dict | None,
        hf: dict | None) -> dict[str, Any]:
    """One table row from a decoder-format result (``summary`` + ``samples``)."""
    s, samples = result["summary"], result["samples"]
    tps = per_prompt_tps(samples)
    return {"method": method, "temperature": temperature, "k": s.get("k"),
            "k_source": s.get("k_source"), "tree_size": s.get("tree_size"),
            "draft_kind": s.get("draft_kind"), "draft_vocab": s.get("draft_vocab"),
            "tokens": s["tokens_generated"], "median_tokens_per_s": statistics.median(tps),
            "tokens_per_s": s["tokens_per_s"], "tau": s.get("tau"),
            "acceptance_rate": s.get("acceptance_rate"), "alpha": s.get("alpha") or [],
            "speedup_vs_plain": speedup_over(samples, plain["samples"]) if plain else None,
            "speedup_vs_hf_generate": speedup_over(samples, hf["samples"]) if hf else None,
            "lossless": s.get("lossless"),
            # T=0: share of prompts whose output equals plain decoding's (lossless check)
            "same_as_plain": (statistics.fmean(a["output_ids"] == b["output_ids"] for a, b in
                                               zip(samples, plain["samples"]))
                              if plain and temperature == 0 else None)}


# ----------------------------------------------------------------------------- decoding
def _ours(cfg: DictConfig, loaded: Any, draft: str, temperature: float, k: int | None,
          tree: str, adaptive: bool | None = None, draft_vocab: Any = None) -> dict:
    adaptive = bool(cfg.adaptive_k) if adaptive is None else adaptive
    dcfg = OmegaConf.merge(OmegaConf.load(decode.CONF_FILE), {
        "draft_vocab": cfg.draft_vocab if draft_vocab is None else draft_vocab,
        "draft": draft, "prompts": str(repo_path(cfg.questions)), "limit": int(cfg.limit),
        "max_new_tokens": int(cfg.max_new_tokens), "temperature": float(temperature), "k": k,
        "adaptive_k": adaptive, "fallback": adaptive, "tree": tree,
        "tree_topk": int(cfg.tree_topk), "tree_size": cfg.tree_size,
        "medusa_branching": (None if cfg.medusa_branching is None else list(cfg.medusa_branching)),
        "baseline": False, "dtype": cfg.dtype, "suffix": False,  # the package alone
        "device": cfg.device, "seed": int(cfg.seed), "out": None})
    return decode.run(dcfg, loaded)


@dataclass
class _Plan:
    """What the decoding benchmark runs, settled once before the temperatures."""

    drafts: dict[str, str]  # family -> package
    k_of: dict[str, tuple[int, str]]  # family -> (K, where it came from)
    assist: str | None  # the family that can be transformers' assistant_model
    k_lm: int
    k_src: str
    assistant: Any  # the assistant's module, or None
    tree_depth_of: dict[tuple[str, float | None], int | None]  # (family, T) -> measured depth
    vocab_of: dict[str, Any]  # family -> its measured draft vocabulary (or FULL)
    assisted_ks: list[int]


def _plan(cfg: DictConfig, loaded: Any) -> _Plan:
    drafts = draft_paths(cfg)
    k_of = {fam: package_k(path, cfg.k, cfg.dtype, cfg.device) for fam, path in drafts.items()}
    # the draft that can be transformers' assistant_model (a whole causal LM) runs assisted too
    assist = next((fam for fam in drafts if FAMILIES[fam].hf_model), None)
    k_lm, k_src = k_of.get(assist) or package_k(None, cfg.k)
    assistant = None
    if assist is not None and cfg.hf_generate:
        pkg = load_draft(drafts[assist], loaded)
        assistant = pkg.module.to(device=cfg.device, dtype=getattr(torch, cfg.dtype)).eval()
    # a measured dynamic tree runs too; assisted generation then also runs at its depth, so
    # that each of ours has transformers' assisted generation at the same K
    tree_depth_of = {(fam, t): measured_tree(path, cfg, t) if cfg.k is None else None
                     for fam, path in drafts.items() for t in [None, *map(float, cfg.temperatures)]}
    lm_tree_depth = tree_depth_of.get((assist, None))
    vocab_of = {}
    for fam, path in drafts.items():
        measured, _ = Measured.of(speculation_of(path), cfg.dtype, cfg.device)
        if FAMILIES[fam].draft_vocab:
            vocab_of[fam] = (measured.draft_vocab if measured and measured.draft_vocab
                             else FULL)
    assisted_ks = sorted({k_lm} | ({lm_tree_depth} if lm_tree_depth else set()))
    return _Plan(drafts, k_of, assist, k_lm, k_src, assistant, tree_depth_of, vocab_of,
                 assisted_ks)


def _peers(cfg: DictConfig, loaded: Any, records: list[dict], t: float,
           plan: _Plan) -> tuple[dict | None, dict[str, dict]]:
    """transformers at temperature ``t``: ``generate`` and the peers (assisted generation at
    each K, stock and with native GQA; prompt lookup)."""
    from draftsmith.eval.peers import run_peer_on

    model, tok = loaded.model, loaded.tokenizer
    common = {"temperature": t, "max_new_tokens": int(cfg.max_new_tokens), "seed": int(cfg.seed),
              "tokenizer": tok, "baseline": False}
    hf, peers = None, {}
    if cfg.hf_generate:
        note(TOOL, f"T={t}: transformers generate")
        hf = run_peer_on(model, records, "hf_generate", **common)
        for k_a in plan.assisted_ks if plan.assistant is not None else []:
            # stock, and with the native-GQA attention our decoder's forwards use (like for
            # like: what is left is the decoding loop)
            for suffix, gqa in (("", False), (" native-gqa", True)):
                note(TOOL, f"T={t}: transformers generate(assistant_model=lm), K={k_a}{suffix}")
                with native_gqa(gqa):
                    peers[f"hf_assisted K={k_a}{suffix}"] = run_peer_on(
                        model, records, "hf_assisted", k=k_a, schedule="constant",
                        assistant=plan.assistant, **common)
    if cfg.prompt_lookup:
        note(TOOL, f"T={t}: transformers prompt_lookup_num_tokens={plan.k_lm}")
        peers["hf_prompt_lookup"] = run_peer_on(model, records, "hf_prompt_lookup",
                                                k=plan.k_lm, **common)
    return hf, peers


def _ours_at(cfg: DictConfig, loaded: Any, t: float, plan: _Plan) -> dict[str, tuple[str, dict]]:
    """Our decoder with every draft at temperature ``t``: name -> (family, result)."""
    ours = {}
    for fam, path in plan.drafts.items():
        family = FAMILIES[fam]
        if family.tree is TreeKind.STATIC:  # its tree is how it drafts
            modes = [("tree", fam)]
        else:  # the chain, and the dynamic tree where it is the default or was measured
            tree_runs = family.tree_by_default or plan.tree_depth_of[fam, t]
            modes = [("chain", fam)] + ([("tree", f"{fam}-tree")] if tree_runs else [])
        # a measured frequent-token draft vocabulary runs as the default; the tree also runs
        # over the whole vocabulary, which shows what the smaller LM head buys
        vocabs = [(None, "")]
        if fam in plan.vocab_of and plan.vocab_of[fam] != FULL and cfg.draft_vocab is None:
            vocabs.append((FULL, " full-vocab"))
        for tree, name in modes:
            for vocab, suffix in vocabs if tree == "tree" else vocabs[:1]:
                note(TOOL, f"T={t}: ours {name}{suffix}")
                depth = plan.tree_depth_of[fam, t] if tree == "tree" else None
                if depth:  # the measured tree shape (also where it does not pay: shown as such)
                    res = _ours(cfg, loaded, path, t, depth, tree, draft_vocab=vocab)
                    res["summary"]["k_source"] = "speculation.json (tree)"
                else:
                    res = _ours(cfg, loaded, path, t, plan.k_of[fam][0], tree, draft_vocab=vocab)
                    res["summary"]["k_source"] = plan.k_of[fam][1]
                ours[name + suffix] = (fam, res)
        if cfg.auto_rows and family.tree is TreeKind.DYNAMIC:
            # the decoder's defaults: K from speculation.json (else 4), adaptive K and the
            # fallback to plain decoding when speculation is measured to be a loss
            note(TOOL, f"T={t}: ours {fam} (decode.py defaults: adaptive K + fallback)")
            res = _ours(cfg, loaded, path, t, None, "chain", adaptive=True)
            ours[f"{fam} adaptive+fallback"] = (fam, res)
    return ours


def bench_decoding(cfg: DictConfig, loaded: Any, records: list[dict]) -> list[dict]:
    """Every decoding method at every temperature; rows of :func:`row`."""
    plan = _plan(cfg, loaded)
    rows = []
    for t in [float(x) for x in cfg.temperatures]:
        note(TOOL, f"T={t}: plain decoding (ours)")
        plain = _ours(cfg, loaded, "none", t, 0, "auto")
        hf, peers = _peers(cfg, loaded, records, t, plan)
        ours = _ours_at(cfg, loaded, t, plan)
        note(TOOL, f"T={t}: plain decoding (ours) again: the drift of the machine during this "
                   "block")
        rows.append(row("plain (ours)", plain, t, plain, hf))
        rows.append(row("plain (ours), again last", _ours(cfg, loaded, "none", t, 0, "auto"), t,
                        plain, hf))
        if hf is not None:
            rows.append(row("hf_generate", hf, t, plain, hf))
        for name, res in peers.items():
            res["summary"]["k_source"] = plan.k_src
            rows.append(row(name, res, t, plain, hf))
        for name, (fam, res) in ours.items():
            r = row(f"ours {name}", res, t, plain, hf)
            if fam == plan.assist and "adaptive" not in name:  # the assistant's draft, same K
                for key, suffix in (("speedup_vs_hf_assisted", ""),
                                    ("speedup_vs_hf_assisted_gqa", " native-gqa")):
                    same_k = peers.get(f"hf_assisted K={r['k']}{suffix}")
                    if same_k is not None:
                        r[key] = speedup_over(res["samples"], same_k["samples"])
            rows.append(r)
    return rows


# ----------------------------------------------------------------------------- verify cost
def bench_forward_costs(cfg: DictConfig, loaded: Any, records: list[dict]) -> list[dict]:
    """Target forward time per number of new tokens (1 = a plain step, K + 1 = verifying K
    drafts), after the first question's prompt, for each dtype: what K* trades against."""
    import copy

    from draftsmith.eval.decoding.target_model import Target
    from draftsmith.eval.kstar import forward_costs

    out = []
    for name in cfg.forward_costs.dtypes:
        note(TOOL, f"target forward cost per width ({name})")
        # the benchmark's own dtype times the loaded model itself; others time a converted copy
        model = (loaded.model if name == cfg.dtype
                 else copy.deepcopy(loaded.model).to(dtype=getattr(torch, name)).eval())
        target = Target(model)
        target.prefill(torch.tensor(records[0]["prompt_ids"]))
        t = forward_costs(target, list(cfg.forward_costs.widths), int(cfg.forward_costs.repeats))
        out.append({"dtype": name, "context_tokens": len(records[0]["prompt_ids"]),
                    "repeats": int(cfg.forward_costs.repeats),
                    "ms": {w: v * 1e3 for w, v in t.items()}})
        del model, target
    return out


# ----------------------------------------------------------------------------- report
def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _k_cell(r: dict) -> str:
    k = ("-" if r["k"] is None else f"{r['k']} ({r['k_source']})" if r["k_source"]
         else str(r["k"]))
    if r.get("tree_size"):
        k += f", {r['tree_size']} nodes"
    if r.get("draft_vocab"):
        k += f", {r['draft_vocab']} draft ids"
    return k


def results_markdown(res: dict) -> list[str]:
    """``results.md``'s lines: the decoding table, ours against assisted generation, the
    fallback bound and the target's forward costs."""
    env = res["environment"]
    cfg = res["config"]
    lines = ["# draftsmith benchmark", "",
             f"- date: {env['date']}",
             f"- hardware: {env['hardware']}",
             f"- versions: {env['versions']}",
             f"- dtype: {cfg['dtype']}, device: {cfg['device']}",
             (f"- prompts: {res['prompts']} ({res['n_prompts']} questions, first turn, "
              f"{cfg['max_new_tokens']} new tokens)"),
             f"- command: `{res['command']}`",
             "",
             ("Tokens/s: median over prompts. Ratios: per prompt against plain decoding (ours) "
              "and transformers generate on the same prompt in this run, median over prompts. "
              "Same as plain (T=0): share of prompts with output identical to plain decoding."),
             ""]
    lines += table(["T", "method", "K", "tokens/s", "vs plain", "vs generate", "tau", "accept",
                    "same as plain"],
                   [[f"{r['temperature']:g}", r["method"], _k_cell(r),
                     _fmt(r["median_tokens_per_s"], ".1f"), f"{_fmt(r['speedup_vs_plain'])}x",
                     f"{_fmt(r['speedup_vs_hf_generate'])}x", _fmt(r["tau"]),
                     _fmt(r["acceptance_rate"]), _fmt(r["same_as_plain"])]
                    for r in res["decoding"]])
    vs_assisted = [r for r in res["decoding"] if r.get("speedup_vs_hf_assisted") is not None]
    if vs_assisted:
        lines += ["", "## Ours against transformers assisted generation, same draft LM and K", "",
                  ("Per prompt: our tokens/s over `generate(assistant_model=<the draft LM>)` at "
                   "the same K (chain length, or tree depth for the dynamic tree); median over "
                   "prompts. Stock transformers, and transformers with the native-GQA attention "
                   "our forwards use (`TRANSFORMERS_SDPA_FORCE_GQA=1`)."), ""]
        lines += table(["T", "ours", "K", "vs assisted", "vs assisted, native GQA"],
                       [[f"{r['temperature']:g}", r["method"], r["k"],
                         f"{r['speedup_vs_hf_assisted']:.2f}x",
                         f"{_fmt(r.get('speedup_vs_hf_assisted_gqa'))}x"] for r in vs_assisted])
    if res.get("fallback_bound"):
        lines += fallback_markdown(res["fallback_bound"])
    if res["forward_costs"]:
        lines += _forward_costs_markdown(res["forward_costs"])
    return lines


def _forward_costs_markdown(costs: list[dict]) -> list[str]:
    widths = list(costs[0]["ms"])
    return ["", "## Target forward cost per number of new tokens", "",
            (f"Median of {costs[0]['repeats']} cached forwards after the first question's "
             f"{costs[0]['context_tokens']}-token prompt, in ms (ratio to 1 token). 1 token is a "
             "plain step; K + 1 tokens verify K drafts."), ""] + table(
        ["dtype", *map(str, widths)],
        [[f["dtype"], *(f"{f['ms'][w]:.1f} ({f['ms'][w] / f['ms'][widths[0]]:.2f})"
                        for w in widths)] for f in costs])


def _validate(cfg: DictConfig) -> Path:
    """Every setting and ``out_dir`` (not an input), before the target loads; the questions."""
    questions = repo_path(cfg.questions)
    check_prompt_set(questions)  # a missing file, or a bad record (e.g. "turns": [])
    for key, least in (("limit", 1), ("max_new_tokens", 1), ("k", 0)):  # k: null = K*
        if cfg[key] is not None and integer(key, cfg[key], f"an integer >= {least}") < least:
            raise ValueError(f"{key} must be >= {least}, got {cfg[key]}")
    for t in cfg.temperatures:
        check_sampling(t)
    inputs = {"questions": questions, **{f: repo_path(cfg[f]) for f in FAMILIES if cfg.get(f)}}
    check_out_dir("out_dir", repo_path(cfg.out_dir), inputs, ("results.json", "results.md"))
    return questions


def run(cfg: DictConfig) -> dict:
    """Run the benchmark; returns the ``results.json`` dict."""
    from draftsmith.data.target import load_target

    questions = _validate(cfg)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    t0 = time.perf_counter()
    cfg.dtype = resolve_dtype(cfg.dtype, str(cfg.device))  # auto: the faster one measured here
    loaded = load_target(cfg.target_path, dtype=getattr(torch, cfg.dtype))
    loaded.model.to(cfg.device).eval()
    records = session.prompt_records(str(questions), loaded.tokenizer, int(cfg.limit))
    forward = bench_forward_costs(cfg, loaded, records) if cfg.forward_costs.enabled else []
    decoding = bench_decoding(cfg, loaded, records)
    fallback = bench_fallback(cfg, loaded, records) if cfg.fallback_bound.enabled else []
    res = {"config": OmegaConf.to_container(cfg, resolve=True), "prompts": str(questions),
           "n_prompts": len(records), "target": loaded.identity.to_dict(),
           "forward_costs": forward, "decoding": decoding, "fallback_bound": fallback,
           "bench_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "bench_wall_s": time.perf_counter() - t0,
           "environment": environment(cfg.device),
           "command": "python scripts/bench.py " + " ".join(sys.argv[1:])}
    out = repo_path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    write_markdown(out / "results.md", results_markdown(res))
    note(TOOL, f"wrote {out / 'results.json'} and {out / 'results.md'} "
               f"({res['bench_wall_s']:.0f} s)")
    return res


@hydra.main(config_path=str(decode.CONF_DIR), config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Command line: run the benchmark, then print its tables."""
    run(cfg)
    print((repo_path(cfg.out_dir) / "results.md").read_text())


if __name__ == "__main__":
    main()
