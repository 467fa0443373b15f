"""Round anatomy: where a round of the decoding loop spends its time, against a plain step.

    python scripts/bench_rounds.py                    # `make bench` runs it (ROUNDS_ARGS=...)
    python scripts/bench_rounds.py target_path=DIR draft=null "methods=[lookup,suffix]" name=qwen

For each method (``conf/eval/bench_rounds.yaml``: prompt lookup, the suffix proposer, the trained
draft with decode.py's defaults, the hybrid of both) the decoder logs every round
(:class:`~eval.decoding.stats.RoundTime`): the proposer's ``propose`` (**draft**), the target's
forward over the pending token and the drafts (**verify**), and the rest of the round
(**bookkeeping**: the acceptance rules, committing, the caches' rollbacks, the proposer's
``accept``, the K controller). Plain decoding runs interleaved per prompt (plain, method, plain)
through the same loop; its median round is the **plain step** every figure is set against.
Speculative rounds only (a fallen-back round is a plain step): medians per round, tokens per
round, the share of the plain step that drafting and bookkeeping cost, and the paired speedup
(median over prompts of tokens/s over the mean of that prompt's two plain runs).
``clock=cpu`` times rounds in the process's CPU time instead of wall time: on a machine shared
with other work, wall times stretch with the load while CPU time counts this process's own work
(all its threads: a two-thread matmul counts twice, a Python step once). With
``profile=true`` the first ``profile_tokens`` of one more prompt run under ``torch.profiler``
per method: the ops of each phase with the most self time.

``out_dir/results.json`` keeps one entry per ``name`` (a run replaces its own name's entry; with
``merge=true`` only the rows of the methods it ran, so that a long table can be measured in
several shorter runs, each row with its own date and its own paired plain step) and
``out_dir/results.md`` shows them all, with the hardware, versions, date and command.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.data.dtype import matmul_rates, resolve_dtype
from draftsmith.data.prompts import check_prompt_set
from draftsmith.eval import decode, session
from draftsmith.eval.checks import check_out_dir, check_sampling, integer
from draftsmith.eval.decoding.kernels import kernels_in
from draftsmith.eval.decoding.proposers_suffix import SuffixProposer
from draftsmith.eval.decoding.stats import RoundTime
from draftsmith.eval.machine import environment

REPO = Path(__file__).resolve().parents[1]
CONF_FILE = decode.CONF_DIR / "bench_rounds.yaml"
METHODS = ("lookup", "suffix", "draft", "hybrid")
PHASES = ("draft", "verify", "bookkeeping")
# round timings: wall time, or the process's CPU time (all its threads), which other processes
# on a shared machine do not inflate (a parallel op counts once per busy thread)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def repo_path(p: str | Path) -> Path:
    """A path from the config: relative paths are relative to the repository."""
    p = Path(str(p)).expanduser()
    return p if p.is_absolute() else (REPO / p).resolve()


def note(msg: str) -> None:
    print(f"[bench_rounds] {msg}", flush=True)


# ----------------------------------------------------------------------------- settings
def decode_config(cfg: DictConfig, method: str) -> DictConfig:
    """decode.py's config for ``method`` (its defaults otherwise)."""
    trained = method in ("draft", "hybrid")
    return OmegaConf.merge(OmegaConf.load(decode.CONF_FILE), {
        "draft": str(repo_path(cfg.draft)) if trained else method,
        **({"suffix": method == "hybrid"} if trained else {}),
        "prompts": str(repo_path(cfg.questions)), "limit": int(cfg.limit),
        "max_new_tokens": int(cfg.max_new_tokens), "temperature": float(cfg.temperature),
        "adaptive_k": bool(cfg.adaptive_k), "fallback": bool(cfg.adaptive_k),
        "dtype": cfg.dtype, "device": cfg.device, "seed": int(cfg.seed), "out": None,
        "compile_draft": cfg.compile_draft if trained else False,
        "fused_draft": cfg.fused_draft if trained else True,
        "draft_kernels": cfg.draft_kernels if trained else "auto",
        **({"tree": str(cfg.tree)} if trained else {})})


def _draft_kernels(proposer: Any) -> str | None:
    """``packed`` / ``default``: the trained draft's own linears (None: no trained draft)."""
    inner = getattr(proposer, "inner", proposer)
    module = getattr(inner, "head", None) or getattr(inner, "model", None)
    return kernels_in(module) if isinstance(module, torch.nn.Module) else None


def _validate(cfg: DictConfig) -> list[str]:
    """Every setting and ``out_dir``, before the target loads; the methods to run."""
    check_prompt_set(repo_path(cfg.questions))
    for key in ("limit", "max_new_tokens"):
        if integer(key, cfg[key], "an integer >= 1") < 1:
            raise ValueError(f"{key} must be >= 1, got {cfg[key]}")
    check_sampling(cfg.temperature)
    if cfg.clock not in CLOCKS:
        raise ValueError(f"clock={cfg.clock!r}: allowed {list(CLOCKS)}")
    bad = [m for m in cfg.methods if m not in METHODS]
    if bad:
        raise ValueError(f"methods: {bad} unknown; allowed {list(METHODS)}")
    methods = [str(m) for m in cfg.methods]
    if cfg.draft is None:
        methods = [m for m in methods if m not in ("draft", "hybrid")]
    elif not repo_path(cfg.draft).is_dir():
        raise ValueError(f"draft={cfg.draft}: no such folder (a draft package), or null")
    else:  # the trained methods' decode.py settings (tree, compile_draft), by decode.py's checks
        decode.validate(decode_config(cfg, "draft"))
    if not methods:
        raise ValueError("nothing to run: methods are empty (draft and hybrid need draft=DIR)")
    if not str(cfg.name).replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"name={cfg.name!r}: letters, digits, - and _ only")
    inputs = {"questions": repo_path(cfg.questions)}
    if cfg.draft is not None:
        inputs["draft"] = repo_path(cfg.draft)
    check_out_dir("out_dir", repo_path(cfg.out_dir), inputs, ("results.json", "results.md"))
    return methods


# ----------------------------------------------------------------------------- one method
def summarize(rounds: list[RoundTime], plain: list[RoundTime]) -> dict[str, Any]:
    """Medians per speculative round (ms) against the plain decoder's median round."""
    spec = [r for r in rounds if r.depth > 0]
    step = statistics.median(r.round_s for r in plain) * 1e3
    out: dict[str, Any] = {"rounds": len(rounds), "speculative_rounds": len(spec),
                           "plain_step_ms": step,
                           "plain_forward_ms": statistics.median(r.forward_s for r in plain) * 1e3,
                           "plain_bookkeeping_ms": statistics.median(
                               r.bookkeeping_s for r in plain) * 1e3}
    if not spec:
        return out
    med = {"draft": statistics.median(r.draft_s for r in spec) * 1e3,
           "verify": statistics.median(r.forward_s for r in spec) * 1e3,
           "bookkeeping": statistics.median(r.bookkeeping_s for r in spec) * 1e3,
           "round": statistics.median(r.round_s for r in spec) * 1e3}
    mean = {"draft": statistics.fmean(r.draft_s for r in spec) * 1e3,
            "verify": statistics.fmean(r.forward_s for r in spec) * 1e3,
            "bookkeeping": statistics.fmean(r.bookkeeping_s for r in spec) * 1e3}
    return {**out, **{f"{k}_ms": v for k, v in med.items()},
            **{f"{k}_ms_mean": v for k, v in mean.items()},
            "overhead_of_plain_step": (med["draft"] + med["bookkeeping"]) / step,
            "verify_of_plain_step": med["verify"] / step,
            "tokens_per_round": statistics.fmean(r.tokens for r in spec),
            "nodes_per_round": statistics.fmean(r.nodes for r in spec),
            "depth_per_round": statistics.fmean(r.depth for r in spec)}


def profile_phases(dec: Any, rec: dict, sampling: session.Sampling, eos: Any,
                   top: int) -> dict[str, Any]:
    """One decode of ``rec`` under ``torch.profiler``: per phase (the decoder's ``round.*``
    scopes) its total and the ``top`` ops by self time, in ms."""
    from torch.profiler import ProfilerActivity, profile

    dec.round_log = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        session.decode_one(dec, rec, 0, sampling, eos)
    totals: dict[str, float] = defaultdict(float)
    ops: dict[str, dict[str, float]] = {p: defaultdict(float) for p in PHASES}
    for ev in prof.events():
        if ev.name.startswith("round."):
            totals[ev.name[6:]] += ev.cpu_time_total / 1e3
            continue
        parent = ev.cpu_parent
        while parent is not None and not parent.name.startswith("round."):
            parent = parent.cpu_parent
        if parent is not None:
            ops[parent.name[6:]][ev.name] += ev.self_cpu_time_total / 1e3
    rounds = max(len(dec.round_log), 1)
    return {"rounds": len(dec.round_log),
            "phase_ms_per_round": {p: totals[p] / rounds for p in PHASES},
            "top_ops_ms_per_round": {p: [[n, t / rounds] for n, t in sorted(
                ops[p].items(), key=lambda kv: -kv[1])[:top]] for p in PHASES}}


def run_method(cfg: DictConfig, method: str, loaded: Any, records: list[dict],
               plain: Any) -> dict[str, Any]:
    """Paired decoding of ``records[:limit]`` with ``method``, every round logged; the record
    after them is the profiled one."""
    records, extra = records[:int(cfg.limit)], records[-1]
    dcfg = decode_config(cfg, method)
    proposer, k, k_source, _ = decode.make_proposer(dcfg, loaded)
    dec = decode.decoder_for(dcfg, loaded.model, proposer, k, records)
    sampling = session.Sampling.from_config(dcfg)
    eos = session.eos_ids(loaded.model)
    dec.round_log, plain.round_log = [], []
    dec.round_clock = plain.round_clock = CLOCKS[str(cfg.clock)]
    res = session.paired(dec, loaded.model, records, sampling, eos, plain=plain)
    row = {"method": method, "date": environment(cfg.device)["date"], "clock": str(cfg.clock),
           "draft_kind": proposer.name, "compile_draft": bool(dcfg.compile_draft),
           # whether the EAGLE head ran as the fused step (eval/decoding/eagle_step.py)
           "fused_draft": getattr(getattr(proposer, "inner", proposer), "step", None) is not None,
           "draft_kernels": _draft_kernels(proposer),
           "k": k, "k_source": k_source,
           "tree_size": getattr(proposer, "total_tokens", None) if proposer.tree else None,
           **summarize(dec.round_log, plain.round_log),
           "tau": res.stats.tau, "speedup": res.speedup,
           "speedup_spread": list(res.speedup_spread or ()), "noisy": res.noisy,
           "matches_plain": res.matches_baseline,
           "plain_tokens_per_s": res.baseline_tokens_per_s,
           "tokens_per_s": res.stats.tokens_per_s,
           # the suffix proposer's rounds: drafted from the match, the package or both
           "suffix_rounds": dict(proposer.choices) if isinstance(proposer, SuffixProposer)
           else None}
    if cfg.profile:
        short = session.Sampling(int(cfg.profile_tokens), sampling.temperature, seed=sampling.seed)
        row["profile"] = profile_phases(dec, extra, short, eos, int(cfg.profile_top))
        row["profile_plain"] = profile_phases(plain, extra, short, eos, int(cfg.profile_top))
    dec.round_log = plain.round_log = None
    note(f"{method}: draft {row.get('draft_ms', 0):.1f} / verify {row.get('verify_ms', 0):.1f} "
         f"/ bookkeeping {row.get('bookkeeping_ms', 0):.1f} ms per round, plain step "
         f"{row['plain_step_ms']:.1f} ms, tau {row['tau']:.2f}, {row['speedup']:.2f}x")
    return row


# ----------------------------------------------------------------------------- report
def _f(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _choices(row: dict) -> str:
    c = row.get("suffix_rounds")
    return "-" if not c else f"{c['suffix']} / {c['inner']} / {c['both']}"


def markdown(results: dict[str, dict]) -> str:
    """Every run in ``results`` as Markdown tables."""
    lines = ["# Round anatomy", "",
             ("Per speculative round of the decoding loop, medians in ms: **draft** (the "
              "proposer's `propose`), **verify** (the target's forward over the pending token "
              "and the drafts), **bookkeeping** (acceptance rules, commit, cache rollbacks, the "
              "proposer's `accept`, the K controller), against the **plain step** (the median "
              "round of plain decoding, interleaved per prompt in the same run). Overhead = "
              "(draft + bookkeeping) / plain step. Speedup: tokens/s over plain decoding's, per "
              "prompt, median (range). `scripts/bench_rounds.py`, `conf/eval/bench_rounds.yaml`."),
             ""]
    for name, res in results.items():
        env, c = res["environment"], res["config"]
        hw = env["hardware"]
        lines += [f"## {name}: {res['target']}, {c['dtype']}", "",
                  f"- command: `{res['command']}`",
                  (f"- date: {env['date']}; hardware: {hw['cpu']}, {hw['cpu_count']} cores, "
                   f"{hw['torch_threads']} torch threads; GEMM GFLOP/s {res.get('gemm_gflops')}"),
                  f"- versions: {env['versions']}",
                  (f"- {res['n_prompts']} prompts of `{c['questions']}` x {c['max_new_tokens']} "
                   f"tokens, T = {c['temperature']:g}, adaptive K and fallback: "
                   f"{c['adaptive_k']}; rounds timed in {c.get('clock', 'wall')} time"),
                  "", ("| method | K (source) | nodes | draft | verify | bookkeeping | plain "
                       "step | overhead | tokens / round | tau | speedup | spec. rounds | "
                       "suffix / draft / both |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["methods"]:
            spread = r.get("speedup_spread") or [None, None]
            sp = (f"{_f(r['speedup'], '.2f')}x ({_f(spread[0], '.2f')}-{_f(spread[1], '.2f')})"
                  + (" noisy" if r.get("noisy") else ""))
            lines.append(
                f"| {r['method']} ({r['draft_kind']}"
                f"{', torch.compile' if r.get('compile_draft') else ''}"
                f"{', fused step' if r.get('fused_draft') else ''}"
                f"{', packed' if r.get('draft_kernels') == 'packed' else ''}) | "
                f"{r['k']} ({r['k_source']}) | "
                f"{_f(r.get('nodes_per_round'))} | {_f(r.get('draft_ms'))} | "
                f"{_f(r.get('verify_ms'))} | {_f(r.get('bookkeeping_ms'))} | "
                f"{_f(r['plain_step_ms'])} | {_f(r.get('overhead_of_plain_step'), '.0%')} | "
                f"{_f(r.get('tokens_per_round'), '.2f')} | {_f(r['tau'], '.2f')} | {sp} | "
                f"{r['speculative_rounds']} / {r['rounds']} | {_choices(r)} |")
        prof = [r for r in res["methods"] if r.get("profile")]
        if prof:
            lines += ["", ("Top self-time ops per round (`torch.profiler`, the first "
                           f"{c.get('profile_tokens')} tokens of one more prompt; ms per round, "
                           "profiler overhead included):"), ""]
            for r in prof:
                p = r["profile"]
                for phase in PHASES:
                    top = ", ".join(f"`{n}` {t:.2f}" for n, t in p["top_ops_ms_per_round"][phase])
                    lines.append(f"- {r['method']}, {phase} "
                                 f"({p['phase_ms_per_round'][phase]:.1f} ms): {top or '-'}")
            pp = prof[0]["profile_plain"]
            top = ", ".join(f"`{n}` {t:.2f}" for n, t in pp["top_ops_ms_per_round"]["verify"])
            lines.append(f"- plain step, verify ({pp['phase_ms_per_round']['verify']:.1f} ms): "
                         f"{top}")
        lines.append("")
    return "\n".join(lines)


def run(cfg: DictConfig) -> dict:
    """Run the round anatomy for ``cfg.name``; returns its entry of ``results.json``."""
    methods = _validate(cfg)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    cfg.dtype = resolve_dtype(cfg.dtype, str(cfg.device))
    loaded = session.open_target({"target_path": cfg.target_path, "dtype": cfg.dtype,
                                  "device": cfg.device, "kernels": cfg.kernels})
    records = session.prompt_records(str(repo_path(cfg.questions)), loaded.tokenizer,
                                     int(cfg.limit) + 1)  # one more: the profiled prompt
    plain = session.plain_decoder(loaded.model, records)
    rows = []
    for m in methods:
        note(f"{m} on {cfg.limit} prompts x {cfg.max_new_tokens} tokens")
        rows.append(run_method(cfg, m, loaded, records, plain))
    entry = {"config": OmegaConf.to_container(cfg, resolve=True),
             "target": loaded.identity.name, "n_prompts": int(cfg.limit), "methods": rows,
             "gemm_gflops": {k: round(v) for k, v in matmul_rates(str(cfg.device)).items()},
             "environment": environment(cfg.device),
             "command": "python scripts/bench_rounds.py " + " ".join(sys.argv[1:])}
    out = repo_path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    if cfg.merge and str(cfg.name) in results:  # keep the other methods' rows of that name
        ran = {r["method"] for r in rows}
        entry["methods"] = [r for r in results[str(cfg.name)]["methods"]
                            if r["method"] not in ran] + rows
        entry["methods"].sort(key=lambda r: METHODS.index(r["method"]))
    results[str(cfg.name)] = entry
    path.write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results))
    note(f"wrote {path} and {out / 'results.md'}")
    return entry


@hydra.main(config_path=str(decode.CONF_DIR), config_name="bench_rounds", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Command line: run, then print the tables."""
    run(cfg)
    print((repo_path(cfg.out_dir) / "results.md").read_text())


if __name__ == "__main__":
    main()
