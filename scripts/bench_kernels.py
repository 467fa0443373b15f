"""What a target forward of ``w`` new tokens costs with torch's own linears and with oneDNN
prepacked ones (eval/decoding/kernels.py), per dtype, on this machine.

    python scripts/bench_kernels.py                   # `make bench` runs it (KERNELS_ARGS=...)
    python scripts/bench_kernels.py target_path=pkg:qwen2p5_coder_1p5b name=qwen "dtypes=[float32]"

Two copies of the target are loaded, one left as transformers builds it and one packed; each
holds the same ``context`` tokens of a prompt, and every width of ``widths`` is timed on both,
interleaved (``rounds`` passes of ``repeats`` forwards each, median per width and copy), so a
change of the machine's speed reaches both columns alike. Width 1 is a plain decoding step;
width ``K + 1`` verifies ``K`` drafts: the column "in plain steps" is what verification costs in
units of the same copy's plain step, the figure that decides whether drafting can pay.
``out_dir/results.json`` keeps one entry per ``name``; ``results.md`` shows them all.
"""
from __future__ import annotations

import json
import statistics
import sys
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.eval import CONF_DIR, session
from draftsmith.eval.checks import check_out_dir, integer
from draftsmith.eval.decoding.kernels import apply_kernels, packing_unsupported
from draftsmith.eval.decoding.target_model import Target
from draftsmith.eval.kstar import forward_costs
from draftsmith.eval.machine import environment
from draftsmith.scripts.tooling import note as _note
from draftsmith.scripts.tooling import repo_path

DTYPES = ("float32", "bfloat16")
CONF_FILE = CONF_DIR / "bench_kernels.yaml"


def note(msg: str) -> None:
    _note("bench_kernels", msg)


def _validate(cfg: DictConfig) -> None:
    bad = [d for d in cfg.dtypes if d not in DTYPES]
    if bad or not cfg.dtypes:
        raise ValueError(f"dtypes={list(cfg.dtypes)}: allowed a non-empty list of {DTYPES}")
    widths = [integer("widths", w, "integers >= 1") for w in cfg.widths]
    if not widths or min(widths) < 1 or 1 not in widths:
        raise ValueError(f"widths={widths}: integers >= 1, including 1 (the plain step)")
    for key in ("context", "repeats", "rounds"):
        if integer(key, cfg[key], "an integer >= 1") < 1:
            raise ValueError(f"{key} must be >= 1, got {cfg[key]}")
    if not str(cfg.name).replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"name={cfg.name!r}: letters, digits, - and _ only")
    check_out_dir("out_dir", repo_path(cfg.out_dir), {}, ("results.json", "results.md"))


def _context(loaded: Any, n: int) -> torch.Tensor:
    """``n`` tokens of a real chat prompt, repeated to length."""
    ids = session.encode_prompt(loaded.tokenizer, "Write a Python function that parses a CSV "
                                "file of orders and returns the total per customer, with tests.")
    return torch.tensor((ids * (n // len(ids) + 1))[:n])


def time_dtype(cfg: DictConfig, dtype: str) -> tuple[dict[str, Any], str]:
    """Both copies' forward costs in ``dtype`` (``{"widths", "default_ms", "packed_ms", ...}``)
    and the target's name."""
    base = {"target_path": cfg.target_path, "dtype": dtype, "device": "cpu"}
    why_not = packing_unsupported(getattr(torch, dtype), torch.device("cpu"))
    plain = session.open_target({**base, "kernels": "default"})
    if why_not:
        return {"dtype": dtype, "packed": None, "why": why_not}, plain.identity.name
    packed = session.open_target({**base, "kernels": "default"})
    apply_kernels(packed.model, "packed")
    context = _context(plain, int(cfg.context))
    targets = {"default": Target(plain.model), "packed": Target(packed.model)}
    for t in targets.values():
        t.prefill(context)
    widths = sorted({int(w) for w in cfg.widths})
    runs: dict[str, dict[int, list[float]]] = {k: {w: [] for w in widths} for k in targets}
    for r in range(int(cfg.rounds)):
        for kind, target in targets.items():  # interleaved: both copies see the same machine
            for w, s in forward_costs(target, widths, int(cfg.repeats)).items():
                runs[kind][w].append(s * 1e3)
        note(f"{dtype}: round {r + 1} of {cfg.rounds}")
    ms = {k: [round(statistics.median(runs[k][w]), 1) for w in widths] for k in runs}
    return {"dtype": dtype, "widths": widths, "default_ms": ms["default"],
            "packed_ms": ms["packed"], "context": int(cfg.context),
            "statistic": f"median of {cfg.rounds} rounds x {cfg.repeats} forwards"}, \
        plain.identity.name


def markdown(results: dict[str, Any]) -> str:
    intro = ("Milliseconds of one cached target forward over `w` new tokens (width 1: a plain "
             "step; `K + 1`: verifying `K` drafts), both copies of the target timed interleaved "
             "in one process, and each width in units of its own copy's plain step. "
             "`scripts/bench_kernels.py`, `conf/eval/bench_kernels.yaml`, "
             "`eval/decoding/kernels.py`.")
    lines = ["# Target forwards: torch's linears against oneDNN prepacked ones", "", intro, ""]
    for name, e in results.items():
        hw = e["environment"]["hardware"]
        lines += [f"## {name}: {e['target']}", "", f"- command: `{e['command']}`",
                  (f"- date: {e['environment']['date']}; hardware: {hw['cpu']}, "
                   f"{hw['cpu_count']} cores, {hw['torch_threads']} torch threads, ISA "
                   f"{', '.join(hw.get('isa', [])) or 'unknown'}"),
                  f"- versions: {e['environment']['versions']}", ""]
        for d in e["dtypes"]:
            if d.get("packed", True) is None:
                lines += [f"{d['dtype']}: not packed here ({d['why']})", ""]
                continue
            dflt, pk = d["default_ms"], d["packed_ms"]
            lines += [f"{d['dtype']}, context {d['context']} tokens, {d['statistic']}:", "",
                      ("| w | default ms | packed ms | packed / default | default in plain "
                       "steps | packed in plain steps |"), "|---|---|---|---|---|---|"]
            for i, w in enumerate(d["widths"]):
                lines.append(f"| {w} | {dflt[i]:.1f} | {pk[i]:.1f} | {pk[i] / dflt[i]:.2f} | "
                             f"{dflt[i] / dflt[0]:.2f} | {pk[i] / pk[0]:.2f} |")
            lines.append("")
    return "\n".join(lines)


def run(cfg: DictConfig) -> dict[str, Any]:
    """Time ``cfg.name``'s target; returns its entry of ``results.json``."""
    _validate(cfg)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    timed = [time_dtype(cfg, str(d)) for d in cfg.dtypes]
    rows = [row for row, _ in timed]
    entry = {"config": OmegaConf.to_container(cfg, resolve=True), "target": timed[0][1],
             "dtypes": rows, "environment": environment("cpu"),
             "command": "python scripts/bench_kernels.py " + " ".join(sys.argv[1:])}
    out = repo_path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    results[str(cfg.name)] = entry
    path.write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results))
    note(f"wrote {path} and {out / 'results.md'}")
    return entry


@hydra.main(config_path=str(CONF_DIR), config_name="bench_kernels", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Command line: run, then print the tables."""
    run(cfg)
    print((repo_path(cfg.out_dir) / "results.md").read_text())


if __name__ == "__main__":
    main()
