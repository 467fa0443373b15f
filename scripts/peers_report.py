"""One evaluator for ``make peers``: every trainer's checkpoint scored the same way, and the
results written (``results.json``, ``README.md``).

* **alpha-hat**: draftsmith's validation (``train.validation.validate_draft``) of the checkpoint
  as ``eval/draft.py``'s ``load_draft`` reads it (a peer's folder as an unsigned import), on the
  held-back split of the same cache, in fp32, at ``eval.temperature``.
* **tau and speedup**: ``eval/decode.py`` on ``eval.prompts`` (``eval.limit`` x
  ``eval.max_new_tokens``) with ``eval.overrides``, the same for every checkpoint; the speedup is
  paired with plain decoding of the same prompts in the same run.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from draftsmith.eval.machine import environment
from draftsmith.eval.markdown import table, write_markdown
from draftsmith.scripts.tooling import note


def score_alpha(checkpoint: str, prep: dict, cfg: DictConfig) -> dict:
    """Validation alpha-hat per position of ``checkpoint`` on the held-back split."""
    from accelerate import Accelerator

    from draftsmith.data.feature_data import open_features
    from draftsmith.data.teacher import logit_softcap
    from draftsmith.eval.draft import load_draft
    from draftsmith.scripts.peers_data import vocab_map
    from draftsmith.train.trainable import DistillModule, TrainableDraft
    from draftsmith.train.validation import validate_draft

    loaded = prep["loaded"]
    model = loaded.model.float()
    pkg = load_draft(checkpoint, loaded)
    family, head = pkg.family, pkg.module.float().eval()
    d2t_ref, _ = vocab_map(prep)
    same_vocab = bool(torch.equal(family.draft_to_target(head, pkg.head_config).cpu(), d2t_ref))
    val = open_features(prep["val_dir"], model)
    n = int(head.cfg.ttt_steps)
    module = DistillModule(head, family.distill_targets,
                           family.distill_extra(n, list(getattr(val, "layers", None) or [])))
    draft = TrainableDraft(family.name, module, pkg.head_config, num_positions=n,
                           position_weights=[1.0] * n, identity=loaded.identity,
                           draft_to_target=family.draft_to_target(head, pkg.head_config))
    lm_head = model.get_output_embeddings().weight.detach()
    got = validate_draft(draft, val, Accelerator(cpu=True), int(cfg.eval.micro_batch_size),
                         cfg.eval.eval_batches, float(cfg.eval.temperature), lm_head,
                         logit_softcap(model.config))
    return {**got, "same_vocab_map": same_vocab}


def decode_checkpoint(checkpoint: str, prep: dict, cfg: DictConfig, out: Path) -> dict:
    """``eval/decode.py`` on the checkpoint (its summary)."""
    from draftsmith.eval import decode
    from draftsmith.eval.sweep import outside_hydra

    path = prep.get("target_path")  # as training named it (a package's identity is checked)
    overrides = [f"draft={checkpoint}", f"prompts={cfg.eval.prompts}", f"limit={cfg.eval.limit}",
                 f"max_new_tokens={cfg.eval.max_new_tokens}", f"out={out}",
                 *([f"target_path={path}"] if path else []), *cfg.eval.overrides]
    with outside_hydra():
        return decode.run_overrides(overrides)["summary"]


def score_all(cfg: DictConfig, prep: dict, rows: list[dict], work: Path) -> list[dict]:
    """Each row with a checkpoint gets ``alpha_hat``, ``top1``, ``tau``, ``speedup`` and the
    decode run's file; a scoring failure is recorded in the row."""
    scored = []
    for row in rows:
        ckpt = row.get("checkpoint")
        if ckpt is None:
            scored.append(row)
            continue
        note("peers", f"scoring {row['trainer']}: {ckpt}")
        try:
            val = score_alpha(ckpt, prep, cfg)
            run = decode_checkpoint(ckpt, prep, cfg, work / f"decode_{row['trainer']}.json")
        except Exception as e:  # noqa: BLE001 (recorded in the results)
            scored.append({**row, "error": f"scoring: {type(e).__name__}: {e}"})
            continue
        scored.append({**row, "alpha_hat": val["alpha_hat"], "top1": val["top1"],
                       "val_tokens": val["tokens"], "same_vocab_map": val["same_vocab_map"],
                       "tau": run["tau"],
                       "speedup": run["speedup"], "speedup_spread": run["speedup_spread"],
                       "noisy": run["noisy"], "lossless": run["lossless"],
                       "matches_baseline": run["matches_baseline"],
                       "decode_run": str(work / f"decode_{row['trainer']}.json")})
    return scored


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, list):
        return " / ".join(f"{x:.{digits}f}" for x in v)
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def readme_lines(result: dict) -> list[str]:
    """``README.md`` of the results: the table, the ratios against draftsmith, the failures."""
    rows, meta = result["rows"], result["meta"]
    ours = next((r for r in rows if r["trainer"] == "draftsmith" and "tokens_per_s" in r), None)
    header = ["trainer", "version", "trained tokens", "tokens/s", "alpha-hat per position",
              "tau", "speedup"]
    body = [[r["trainer"], r.get("version") or "-", _fmt(r.get("trained_tokens")),
             _fmt(r.get("tokens_per_s"), 1), _fmt(r.get("alpha_hat")), _fmt(r.get("tau"), 2),
             _fmt(r.get("speedup"), 2) + ("x" if r.get("speedup") is not None else "")]
            for r in rows if "error" not in r]
    s = meta["settings"]
    lines = ["# The peers' trainers side by side", "",
             (f"`{meta['command']}` on {result['environment']['hardware'].get('cpu')} "
             f"({result['environment']['date']}): the EAGLE-3 head of `experiment="
             f"{meta['experiment']}` (fused layers {meta['fuse_layers']}, "
             f"{meta['draft_vocab_size']} draft ids), {s['steps']} steps of "
             f"{s['sequences_per_step']} sequences, lr {s['lr']:g} ({s['warmup_steps']} warm-up "
             f"steps, cosine), {s['positions']} positions with decay {s['decay']:g}, "
             f"{s['precision']}, {s['threads']} threads. Data and features: "
             f"{meta['feature_s']:.0f} s, apart from the training times."), ""]
    lines += table(header, body)
    if ours is not None:
        lines += ["", "Training throughput against draftsmith's, from the same run:"]
        lines += [f"- {r['trainer']}: {r['tokens_per_s'] / ours['tokens_per_s']:.2f}x"
                  for r in rows if "tokens_per_s" in r and r is not ours]
    failed = [r for r in rows if "error" in r]
    if failed:
        lines += ["", "Did not train or score here:"]
        lines += [f"- {r['trainer']}: `{r['error'].splitlines()[-1][:400]}`" for r in failed]
    return lines


def write_results(out: Path, rows: list[dict], meta: dict) -> dict:
    """``out/results.json`` and ``out/README.md``; returns the results."""
    out.mkdir(parents=True, exist_ok=True)
    keep = ("trainer", "version", "trained_tokens", "loss_positions", "tokens_per_s",
            "train_loop_s",
            "alpha_hat", "top1", "val_tokens", "same_vocab_map", "tau", "speedup",
            "speedup_spread", "noisy",
            "lossless", "matches_baseline", "steps", "peak_rss_mib", "wall_s", "command",
            "checkpoint", "decode_run", "error")
    result = {"rows": [{k: r[k] for k in keep if k in r} for r in rows], "meta": meta,
              "environment": environment()}
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(out / "README.md", readme_lines(result))
    note("peers", f"wrote {out / 'results.json'} and {out / 'README.md'}")
    return result
