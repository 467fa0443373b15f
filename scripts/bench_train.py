"""Training and feature-caching throughput on the real target, every variant in ONE run.

    python scripts/bench_train.py                         # part of `make bench`
    python scripts/bench_train.py steps=20 caching.enabled=false

Training: each variant is ``train/distill.py`` as a subprocess (so it runs exactly as a user's
job, allocator settings included) for ``steps`` optimizer steps on the quickstart's cached
features. Tokens/s counts trained position-1 tokens (assistant tokens, no padding) over the
steps after ``warmup_steps``, from the run's ``train_log.jsonl``; the first step's FLOPs
(``train.count_flops``: matmuls and attention, forward and backward) give FLOPs per token, and
achieved FLOP/s over this machine's bf16 and fp32 GEMM rates (measured here, same run) is the
MFU. Ratios are against the ``baseline`` variant.

Caching: the target runs over the same conversations once per setting (parameter dtype, batch
size) into a temporary cache; cached tokens/s, and the total variation between the teacher from
each cache and the fp32 target's own next-token distribution on the first sequences.

Writes ``<out_dir>/results.json`` and ``results.md`` (hardware, versions, date, command).
"""
from __future__ import annotations

from draftsmith.data.malloc import MALLOC_SWITCH, TUNED_MALLOC, restart_as_command

restart_as_command(__name__, "draftsmith-bench-train")  # the tuned allocator, before torch loads

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.data.dtype import matmul_rates
from draftsmith.eval import CONF_DIR
from draftsmith.eval.machine import environment
from draftsmith.eval.markdown import table, write_markdown
from draftsmith.scripts.tooling import REPO, note, repo_path

CONF_FILE = REPO / "conf" / "eval" / "bench_train.yaml"
TOOL = "bench-train"  # the tag of its progress lines


def run_with_peak_rss(cmd: list[str], log: Path, timeout_s: float,
                      env: dict[str, str] | None = None,
                      drop: tuple[str, ...] = ()) -> tuple[int, float, float]:
    """Run ``cmd`` with this environment less ``drop`` plus ``env``; returns (exit code, wall
    seconds, peak RSS in MiB of it and its children). This process runs with the tuned
    allocator, so the variants drop its variables and each sets up its own."""
    t0 = time.perf_counter()
    base = {k: v for k, v in os.environ.items() if k not in drop}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**base, **(env or {})})
        deadline = t0 + timeout_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.2)
    return os.waitstatus_to_exitcode(status), time.perf_counter() - t0, usage.ru_maxrss / 1024


def step_rates(records: list[dict], warmup_steps: int) -> dict[str, Any]:
    """Tokens/s over the logged steps after ``warmup_steps`` (from cumulative tokens and
    elapsed seconds), the median per-step time, and FLOPs per token of the first step."""
    steps = [r for r in records if "elapsed_s" in r]
    flops = next((r for r in records if "flops_first_step" in r), None)
    out: dict[str, Any] = {"logged_steps": len(steps)}
    if flops is not None and flops["tokens_first_step"]:
        out["flops_per_token"] = flops["flops_first_step"] / flops["tokens_first_step"]
    after = [r for r in steps if r["step"] > warmup_steps]
    start = {"step": 0, "tokens": 0, "elapsed_s": 0.0}  # elapsed_s counts from the first step
    base = next((r for r in [start, *steps] if r["step"] == warmup_steps), None)
    if base is None or len(after) < 1:
        return out
    last = after[-1]
    out["tokens_per_s"] = ((last["tokens"] - base["tokens"])
                           / (last["elapsed_s"] - base["elapsed_s"]))
    times = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip([base, *after[:-1]], after)]
    out["median_step_s"] = statistics.median(times)
    out["tokens_per_step"] = (last["tokens"] - base["tokens"]) / len(after)
    return out


def bench_training(cfg: DictConfig, gemm: dict[str, float]) -> list[dict]:
    """Each variant for ``cfg.steps`` steps; rates, FLOPs, MFU and ratios to the baseline."""
    rows = []
    for v in cfg.variants:
        if cfg.get("only") and v.name not in cfg.only:
            continue
        with tempfile.TemporaryDirectory(prefix=f"bench-train-{v.name}-") as tmp:
            cmd = [sys.executable, str(REPO / "train" / "distill.py"), f"out_dir={tmp}",
                   "logging=none", f"train.max_steps={int(cfg.steps)}",
                   f"train.micro_batch_size={int(cfg.micro_batch_size)}", "train.log_every=1",
                   "train.eval_batches=1", f"train.eval_every={10 ** 6}",
                   f"train.save_every={10 ** 6}", "train.resume=false", "train.count_flops=true",
                   *cfg.data_overrides, *v.overrides]
            if cfg.target_path:
                cmd.append(f"target.path={cfg.target_path}")
            note(TOOL, f"training: {v.name} ({cfg.steps} steps)")
            log = Path(tmp) / "bench.log"
            env = {k: str(x) for k, x in (v.get("env") or {}).items()}
            rc, wall, rss = run_with_peak_rss(cmd, log, float(cfg.timeout_s), env,
                                              drop=(*TUNED_MALLOC, MALLOC_SWITCH))
            path = Path(tmp) / "train_log.jsonl"
            recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] \
                if path.is_file() else []
            seen = re.search(r"malloc=(\w+)", log.read_text())  # what the run logged it used
            row = {"name": v.name, "what": v.what, "exit_code": rc, "wall_s": wall,
                   "peak_rss_mib": rss, "command": " ".join(cmd[1:]), "env": env,
                   "malloc": seen.group(1) if seen else None,
                   **step_rates(recs, int(cfg.warmup_steps))}
            if "flops_per_token" in row and "tokens_per_s" in row:
                row["flop_per_s"] = row["flops_per_token"] * row["tokens_per_s"]
                row["mfu_bf16"] = row["flop_per_s"] / (gemm["bfloat16"] * 1e9)
                row["mfu_fp32"] = row["flop_per_s"] / (gemm["float32"] * 1e9)
            if rc != 0 or "tokens_per_s" not in row:
                row["error_tail"] = log.read_text()[-1500:]
                note(TOOL, f"training {v.name} failed (exit {rc}); see results.json error_tail")
            rows.append(row)
    base = next((r for r in rows if r["name"] == cfg.baseline), None)
    for r in rows:
        if base and base.get("tokens_per_s") and r.get("tokens_per_s"):
            r["vs_baseline"] = r["tokens_per_s"] / base["tokens_per_s"]
    return rows


def bench_caching(cfg: DictConfig) -> list[dict]:
    """Cached tokens/s per (target dtype, batch size), and each cache's teacher total variation
    against the fp32 target's own distribution."""
    from draftsmith.data.chat import tokenize_conversations
    from draftsmith.data.feature_data import open_features
    from draftsmith.data.features import build_feature_cache
    from draftsmith.data.sharegpt import read_sharegpt
    from draftsmith.data.target import load_target

    c = cfg.caching
    path = cfg.target_path  # None = the packaged SmolLM2-135M-Instruct
    ref = load_target(path, dtype=torch.float32)
    convs, _ = read_sharegpt(None, limit=int(c.conversations))
    ds, _ = tokenize_conversations(convs, ref.tokenizer, int(c.max_length))
    rows = [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in ds]
    ntok = sum(len(r["input_ids"]) for r in rows)
    w = ref.model.get_output_embeddings().weight.detach().float()
    probe = rows[: int(c.tv_sequences)]
    with torch.no_grad():
        ref_p = [torch.softmax(ref.model(input_ids=torch.tensor([r["input_ids"]])).logits[0]
                               .float(), -1) for r in probe]
    out = []
    for s in c.settings:
        target = ref if s.dtype == "float32" else load_target(path, dtype=getattr(torch, s.dtype))
        with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
            note(TOOL, f"caching: {ntok} tokens, target {s.dtype}, batch {s.batch_size}")
            t0 = time.perf_counter()
            final_from = s.get("final_from")  # the final hidden state recomputed from a layer
            man = build_feature_cache(target, rows, tmp, batch_size=int(s.batch_size),
                                      progress=False, layers=list(s.get("layers") or []),
                                      final_from=final_from)
            secs = time.perf_counter() - t0
            cache = open_features(tmp, target.model)
            tvs = []
            for i, p in enumerate(ref_p):
                item = cache[i]  # a recomputed final hidden state comes with its batch
                final = (cache.collate([item]) if final_from is not None else item)["hidden"]
                q = torch.softmax(final.reshape(-1, w.shape[1]).float() @ w.T, -1)
                tvs.append(float(0.5 * (p - q).abs().sum(-1).max()))
        out.append({"dtype": s.dtype, "batch_size": int(s.batch_size), "tokens": ntok,
                    "layers": list(s.get("layers") or []), "final_from": final_from,
                    "seconds": secs, "tokens_per_s": ntok / secs,
                    "bytes_per_token": man["bytes_per_token"], "max_tv": max(tvs)})
    base = out[0]["tokens_per_s"] if out else None
    for r in out:
        r["vs_first"] = r["tokens_per_s"] / base
    return out


def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def results_markdown(res: dict) -> list[str]:
    """``results.md``'s lines: the training variants and the feature caching settings."""
    env, gemm = res["environment"], res["gemm_gflops"]
    lines = ["# draftsmith training benchmark", "",
             f"- date: {env['date']}", f"- hardware: {env['hardware']}",
             f"- versions: {env['versions']}", f"- command: `{res['command']}`",
             (f"- GEMM rate here ({res['gemm_shape']}): bf16 {gemm['bfloat16']:.0f} GFLOP/s, "
              f"fp32 {gemm['float32']:.0f} GFLOP/s"), "",
             (f"Training: {res['config']['steps']} steps of {res['config']['micro_batch_size']} "
              f"sequences, tokens/s over the steps after the first {res['config']['warmup_steps']}"
              " (trained position-1 tokens); MFU = FLOPs per token (first step, counted) x "
              "tokens/s over the GEMM rate."), ""]
    lines += table(["variant", "what", "malloc", "tokens/s", "vs baseline", "step (s)",
                    "tokens/step", "GFLOP/token", "MFU bf16", "MFU fp32", "peak RSS (MiB)",
                    "exit"],
                   [[r["name"], r["what"], r.get("malloc") or "-",
                     _f(r.get("tokens_per_s"), ".0f"), f"{_f(r.get('vs_baseline'), '.2f')}x",
                     _f(r.get("median_step_s"), ".2f"), _f(r.get("tokens_per_step"), ".0f"),
                     _f(r.get("flops_per_token", 0) / 1e9 or None, ".2f"),
                     _f(r.get("mfu_bf16"), ".2f"), _f(r.get("mfu_fp32"), ".2f"),
                     f"{r['peak_rss_mib']:.0f}", r["exit_code"]] for r in res["training"]])
    if res["caching"]:
        lines += ["", ("Feature caching (same conversations, temporary cache; max TV = the largest "
                       "total variation between a cached teacher and the fp32 target's own "
                       "distribution on the first sequences):"), ""]
        lines += table(["target dtype", "batch", "layers", "tokens", "tokens/s", "vs first",
                        "bytes/token", "max TV"],
                       [[r["dtype"], r["batch_size"],
                         f"{r.get('layers') or '-'}" + (f", final from {r['final_from']}"
                                                        if r.get("final_from") else ""),
                         r["tokens"], f"{r['tokens_per_s']:.0f}", f"{r['vs_first']:.2f}x",
                         r["bytes_per_token"], f"{r['max_tv']:.2e}"] for r in res["caching"]])
    return lines


def run(cfg: DictConfig) -> dict:
    if int(cfg.steps) <= int(cfg.warmup_steps):
        raise ValueError(f"steps={cfg.steps} must exceed warmup_steps={cfg.warmup_steps}")
    t0 = time.perf_counter()
    shape = tuple(int(x) for x in cfg.gemm_shape)
    gemm = matmul_rates("cpu", *shape)
    caching = bench_caching(cfg) if cfg.caching.enabled else []
    training = bench_training(cfg, gemm) if cfg.variants else []
    res = {"config": OmegaConf.to_container(cfg, resolve=True), "gemm_gflops": gemm,
           "gemm_shape": "x".join(map(str, shape)), "training": training, "caching": caching,
           "wall_s": time.perf_counter() - t0, "environment": environment("cpu"),
           "command": "python scripts/bench_train.py " + " ".join(sys.argv[1:])}
    out = repo_path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    write_markdown(out / "results.md", results_markdown(res))
    note(TOOL, f"wrote {out / 'results.md'} ({res['wall_s']:.0f} s)")
    return res


@hydra.main(config_path=str(CONF_DIR), config_name="bench_train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Command line: run every variant, then print the tables."""
    run(cfg)
    print((repo_path(cfg.out_dir) / "results.md").read_text())


def cli() -> None:  # draftsmith-bench-train or python scripts/bench_train.py
    main()


if __name__ == "__main__":
    cli()
