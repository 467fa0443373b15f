"""An engine job: the runs of one engine process, in the engine's own environment, and what
the engine reports of each.

A job (:func:`engine_job`) holds the target, the prompts and a run per export
(:func:`engine_run`: how the engine reads that format, at which draft lengths it is timed);
:func:`run_engine` runs them in one fresh process of the engine's Python (:func:`engine_ready`,
``scripts/engine_envs.py``) through its runner (``scripts/engine_runners/<engine>_run.py``).
From each run's record: its acceptance per draft position (:func:`engine_acceptance`) and over
the whole run (:func:`engine_rate`), from the engine's own counters, and its paired speedup and
best draft length (:func:`engine_speed`, ``scripts/engine_speed.py``).
"""
from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from omegaconf import DictConfig

from draftsmith.eval.session import NOISE_TOLERANCE
from draftsmith.heads.exports import export_format
from draftsmith.scripts.engine_envs import engine_env, ensure_env
from draftsmith.scripts.engine_speed import best_draft_length, from_timings
from draftsmith.scripts.tooling import REPO

RUNNERS = REPO / "scripts" / "engine_runners"
# a gguf made by llama.cpp's own converter (DraftFamily.gguf_layout) -> llama-server's
# --spec-type (a draft LM's gguf runs in llama-cpp-python)
SPEC_TYPES = {"eagle3": "draft-eagle3", "zlab_dflash": "draft-dflash"}


def engine_ready(engine: str, root: Path) -> tuple[Path, Path | None]:
    """The engine's Python (and llama-server's binary, built once).

    Raises:
        EngineUnavailable: the environment or the build could not be made."""
    python = ensure_env(engine, root)
    if engine != "llama_server":
        return python, None
    from draftsmith.scripts.llama_cpp_build import ensure_built
    return python, ensure_built(root)["llama-server"]


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


def per_position(accepted: list[int], steps: int, k: int) -> list[float | None]:
    """Acceptance per draft position: drafts accepted there over speculative steps."""
    return [(accepted[i] / steps if steps and i < len(accepted) else None) for i in range(k)]


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
