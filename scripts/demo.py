#!/usr/bin/env python
"""`make demo`: the main job on the embedded default, end to end, with every command shown.

1. train   an EAGLE-3 head for SmolLM2-135M-Instruct on a ShareGPT slice whose first replies
           the target rewrites (experiment=quickstart; converts the packaged GGUF target,
           regenerates the replies and builds the feature cache on first use);
2. measure accept rates and costs on this machine, choose K*, write speculation.json;
3. decode  held-out ShareGPT prompts with the trained head against plain decoding (same run);
4. sweep   K on a few prompts and write the report (table + plots);
5. export  the head in the EAGLE-3 layout serving engines load, and decode again from the export;
6. decode  the same prompts with the released EAGLE-3 head (``releases/``, trained longer by
           its release recipe, ``make release``: ``conf/release/eagle3-smollm2-135m.yaml``)
           against plain decoding, in the dtype measured fastest here.

Every stage is a plain command a user can run alone; this script only runs them in order and
prints a summary. Extra arguments are passed to the training command (Hydra overrides of
``train/distill.py experiment=quickstart``); with a Hydra flag (``--cfg job``, ``--info``, ...) only
that training command runs, to answer it, and ``--help`` prints this text.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
OUT = REPO / "outputs" / "quickstart"
DRAFT = OUT / "draft"
RELEASE = REPO / "releases" / "eagle3-smollm2-135m"
PROMPTS = ["prompts=sharegpt", "limit=6", "max_new_tokens=64", "temperature=0"]
# Stage 3 decodes with a fixed 2-token EAGLE chain so that accept rates are visible even when
# K* (stage 2) says speculation does not pay on this machine; K* is the default otherwise.
CHAIN = ["k=2", "tree=chain", "adaptive_k=false", "fallback=false"]


def sh(cmd: list[str], title: str) -> float:
    print(f"\n=== {title}\n$ {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, check=False)
    if proc.returncode != 0:
        sys.exit(f"demo stopped: '{title}' failed with exit code {proc.returncode}")
    return time.perf_counter() - t0


def main(extra: list[str]) -> None:
    if {"-h", "--help"} & set(extra):
        print(__doc__)
        return
    if any(a.startswith("-") for a in extra):  # Hydra flags (--cfg job, ...): training's answer
        i = next((i for i, a in enumerate(extra) if "=" in a), len(extra))  # overrides together
        argv = [*extra[:i], "experiment=quickstart", *extra[i:]]
        sys.exit(subprocess.run([sys.executable, "train/distill.py", *argv], cwd=REPO,
                                check=False).returncode)
    times = {}
    times["train"] = sh([str(BIN / "accelerate"), "launch", "--config_file",
                         "conf/accelerate/single.yaml", "train/distill.py", "experiment=quickstart",
                         *extra], "1. train an EAGLE-3 head (experiment=quickstart)")
    times["measure"] = sh([sys.executable, "eval/measure.py", f"draft={DRAFT}", "prompts=sharegpt",
                           "limit=4", "max_new_tokens=48", "temperature=0",
                           "tree_sizes=[]", "medusa_branchings=[]"],  # chains: no tree-shape search
                          "2. measure accept rates and costs, choose K*, write speculation.json")
    decode_json = OUT / "decode.json"
    times["decode"] = sh([sys.executable, "eval/decode.py", f"draft={DRAFT}", *PROMPTS, *CHAIN,
                          f"out={decode_json}"],
                         "3. speculative decoding vs plain decoding (held-out ShareGPT prompts)")
    sweep_dir = REPO / "outputs" / "sweeps" / "quickstart"
    times["sweep"] = sh([sys.executable, "eval/sweep.py", "-m", f"draft={DRAFT}", "k=1,2,3,4",
                         "prompts=sharegpt", "limit=4", "max_new_tokens=48", "temperature=0",
                         "name=quickstart"], "4. sweep K and write the report")
    export_dir = OUT / "export-eagle3"
    export_json = OUT / "decode-export.json"
    times["export"] = sh([sys.executable, "scripts/export.py", f"draft={DRAFT}", "format=eagle3",
                          f"out={export_dir}", "overwrite=true"],
                         "5a. export in the EAGLE-3 layout (vLLM/SGLang)")
    times["reload"] = sh([sys.executable, "eval/decode.py", f"draft={export_dir}", *PROMPTS,
                          *CHAIN, "baseline=false", f"out={export_json}"],
                         "5b. decode again from the export")
    release_json = OUT / "decode-release.json"
    times["release"] = sh([sys.executable, "eval/decode.py", f"draft={RELEASE}", *PROMPTS,
                           "dtype=auto", f"out={release_json}"],
                          "6. the released EAGLE-3 head vs plain decoding (its measured defaults)")
    summarize(decode_json, export_json, sweep_dir, times, release_json)


def summarize(decode_json: Path, export_json: Path, sweep_dir: Path, times: dict,
              release_json: Path) -> None:
    summary = json.loads((OUT / "summary.json").read_text())
    data = json.loads((DRAFT / "data_report.json").read_text())
    spec = json.loads((DRAFT / "speculation.json").read_text())
    dec = json.loads(decode_json.read_text())
    exp = json.loads(export_json.read_text())
    same = [a["output_ids"] == b["output_ids"] for a, b in zip(dec["samples"], exp["samples"])]
    s = dec["summary"]
    fmt = lambda xs: "[" + ", ".join(f"{x:.3f}" for x in xs) + "]"
    print("\n" + "=" * 72)
    print("draftsmith demo summary")
    print("  target                 SmolLM2-135M-Instruct (CPU; training in the dtype measured "
          "fastest here, decoding stages 3-5 in fp32)")
    print(f"  data                   {data['read']['kept']} ShareGPT conversations read; "
          f"train {data['train']['tokens']} tokens, val {data['val']['tokens']} tokens")
    layers = "/".join(str(i) for i in data["train"].get("layers") or []) or "final"
    print(f"  feature cache          {data['train']['bytes_per_token']:.0f} bytes per token "
          f"(fp16 hidden states of layers {layers} + ids + mask)")
    print(f"  alpha-hat (validation) untrained {fmt(summary['alpha_hat_init'])} -> "
          f"trained {fmt(summary['alpha_hat'])}")
    print(f"  K* on this machine     {spec['k_star']} (expected speedup "
          f"{spec['expected_speedup'].get(str(spec['k_star']), float('nan')):.2f}x; K* = 0 means "
          "plain decoding is fastest here)")
    print(f"  served (greedy, chain K={s['k']}) tau {s['tau']:.2f}, "
          f"acceptance {s['acceptance_rate']:.3f}, "
          f"alpha per position {fmt(s['alpha'][:4])}")
    print(f"  speed                  {s['tokens_per_s']:.1f} tok/s, {s['speedup']:.2f}x plain "
          "decoding measured in the same run")
    print(f"  lossless check         outputs equal plain greedy: "
          f"{dec['summary'].get('matches_baseline', 'see decode.json')}")
    print(f"  export reload          {sum(same)}/{len(same)} prompts decode identically from "
          "the EAGLE-3-layout export")
    print(f"  report                 {sweep_dir / 'report.md'} (+ PNG plots beside it)")
    rel = json.loads(release_json.read_text())["summary"]
    print(f"  released head          {RELEASE.name} ({rel['dtype']}): tau {rel['tau']:.2f}, "
          f"{rel['speedup']:.2f}x plain decoding in the same run, outputs equal plain: "
          f"{rel.get('matches_baseline', 'see decode-release.json')}")
    print("  stage times (s)        " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    print("=" * 72)


def cli() -> None:  # draftsmith-demo or python scripts/demo.py
    main(sys.argv[1:])


if __name__ == "__main__":
    cli()
