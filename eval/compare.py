"""Several drafts head to head in one run, on the same prompts and the same plain runs.

    python eval/compare.py --config-name compare_qwen prompts=humaneval out=bench/x.json

Each entry of ``drafts`` names a draft and the decode.py settings it runs with (its own K, tree,
draft vocabulary, suffix, ...); the shared keys (target, prompts, sampling, dtype) are set once.
Per prompt: plain decoding, every draft in turn, plain decoding again
(:func:`eval.session.paired_many`), so each draft's speedup is over the same plain runs and a
change of the machine's speed within the run hits every draft alike. This is how a release is
set beside its rivals (the Qwen2.5-Coder-1.5B release against the 0.5B sibling off the shelf and
distilled): separate decode.py runs pair each draft with its own plain runs, minutes apart.

Writes ``out`` (JSON: the shared settings, one decode.py ``summary`` per draft and the per-prompt
speedups) and a markdown table beside it (``out`` with ``.md``).
"""
from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from draftsmith.data.dtype import resolve_dtype
from draftsmith.eval import CONF_DIR, decode, session
from draftsmith.eval.checks import check_out_file
from draftsmith.eval.machine import environment
from draftsmith.eval.markdown import table, write_markdown

# decode.py keys every draft shares: set at the top level, refused inside an entry
SHARED = ("target_path", "target", "prompts", "limit", "max_new_tokens", "temperature", "top_k",
          "top_p", "dtype", "device", "threads", "seed", "noise_tolerance", "time_budget_s")
# decode.py keys a comparison does not take (one process, batch 1, every draft against plain)
REFUSED = {"baseline": "every draft is paired with plain decoding",
           "batch_size": "drafts are compared at batch 1 (decode.py batch_size=N pairs batches)",
           "out": "the comparison writes one file (out= at the top level)"}


def draft_configs(cfg: DictConfig) -> dict[str, DictConfig]:
    """decode.py's config of each entry of ``cfg.drafts``: its defaults, the shared keys, then the
    entry's own; every setting checked (decode.py's checks) before any model loads.

    Raises:
        ValueError: no drafts, an entry without ``draft``, a shared, refused or unknown key in
            an entry, or any setting decode.py refuses.
    """
    if not cfg.drafts:
        raise ValueError("drafts is empty: give each draft a name and its settings, e.g. "
                         "drafts={release: {draft: releases/NAME}, lookup: {draft: lookup}}")
    base = OmegaConf.load(decode.CONF_FILE)
    shared = {key: cfg[key] for key in SHARED if key in cfg}
    out = {}
    for name, entry in cfg.drafts.items():
        if not isinstance(entry, Mapping) or "draft" not in entry:
            raise ValueError(f"drafts.{name} needs draft=... (a package or export folder, "
                             "pkg:<key>, lookup, suffix or none) and may set decode.py keys")
        for key in entry:
            if key in SHARED:
                raise ValueError(f"drafts.{name}.{key}: {key} is shared by every draft; set it "
                                 f"once at the top level ({key}=...)")
            if key in REFUSED:
                raise ValueError(f"drafts.{name}.{key}: not taken here: {REFUSED[key]}")
            if key not in base:
                raise ValueError(f"drafts.{name}.{key}: not a decode.py setting (conf/eval/"
                                 "decode.yaml lists them)")
        dcfg = OmegaConf.merge(base, shared, entry, {"out": None})
        decode.validate(dcfg)
        out[str(name)] = dcfg
    return out


def run(cfg: DictConfig, loaded: Any = None, command: str | None = None) -> dict:
    """Decode the prompt set with every draft against the same plain runs; returns the JSON dict
    (also written to ``cfg.out``, with its markdown table; ``command``: the command line, for
    the record)."""
    configs = draft_configs(cfg)
    inputs = {"prompts": cfg.prompts, **{f"drafts.{n}": c.draft for n, c in configs.items()}}
    check_out_file("out", cfg.get("out"), inputs)
    dtype = resolve_dtype(cfg.dtype, str(cfg.device))
    for dcfg in configs.values():
        dcfg.dtype = dtype
    first = next(iter(configs.values()))
    loaded = session.open_target(first, loaded)  # target_path null: the first draft's target
    model = loaded.model
    records = session.prompt_records(cfg.prompts, loaded.tokenizer, cfg.limit)
    # as decode.py: a record measured on another machine is re-timed here, and judged on the run
    made = {name: decode.make_proposer(dcfg, loaded, records) for name, dcfg in configs.items()}
    decs = [decode.decoder_for(configs[name], model, proposer, k, records, shadow)
            for name, (proposer, k, _, shadow) in made.items()]
    results = session.paired_many(decs, model, records, session.Sampling.from_config(first),
                                  session.eos_ids(model), float(cfg.noise_tolerance))
    summaries = {name: decode.summarize(configs[name], res, proposer, dec, k, source)
                 for (name, (proposer, k, source, _)), dec, res in zip(made.items(), decs, results)}
    result = {"command": command, "target": loaded.identity.name, "prompts": str(cfg.prompts),
              "prompt_ids": [r["id"] for r in records], "dtype": dtype,
              "environment": environment(cfg.device),
              "drafts": {name: OmegaConf.to_container(cfg.drafts[name]) for name in configs},
              "summaries": summaries,
              "speedup_per_prompt": {name: [s["speedup"] for s in res.samples]
                                     for name, res in zip(made, results)}}
    if cfg.get("out"):
        out = Path(str(cfg.out)).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        write_markdown(out.with_suffix(".md"), markdown(result, cfg))
    return result


def markdown(result: Mapping[str, Any], cfg: Mapping[str, Any]) -> list[str]:
    """The comparison as a markdown table, one row per draft."""
    rows = []
    for name, s in result["summaries"].items():
        alpha = " / ".join(f"{a:.2f}" for a in s["alpha"][:3]) or "-"
        spread = s["speedup_spread"]
        speedup = f"{s['speedup']:.2f}x" + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread
                                            else "") + (" noisy" if s["noisy"] else "")
        shape = f"{'tree' if s['tree'] else 'chain'} K {s['k']}" + (
            f", {s['tree_size']} nodes" if s["tree"] else "")
        rows.append([name, f"`{s['draft']}`", shape, f"{s['tau']:.2f}", alpha,
                     f"{s['tokens_per_s']:.1f}", speedup,
                     "-" if s["matches_baseline"] is None else f"{s['matches_baseline']:.0%}"])
    plain = next(iter(result["summaries"].values()))["baseline_tokens_per_s"]
    title = (f"# {result['target']}: {len(result['prompt_ids'])} prompts of "
             f"`{result['prompts']}` x {cfg['max_new_tokens']} tokens, T = {cfg['temperature']}, "
             f"{result['dtype']}")
    how = ("Every draft against the same plain runs, one process: per prompt plain, each draft, "
           f"plain again. Plain decoding: {plain:.1f} tokens/s.")
    env = result.get("environment")
    where = []
    if env:
        hw = env["hardware"]
        line = (f"{env['date']}; {hw['cpu']}, {hw['cpu_count']} cores, {hw['torch_threads']} "
                f"torch threads; {env['versions']}")
        where = [line, ""]
    head = [title, "", how, "", *where,
            *([f"`{result['command']}`", ""] if result.get("command") else [])]
    return head + table(["draft", "path", "shape", "tau", "alpha 1 / 2 / 3", "tokens/s",
                         "speedup (range)", "= plain"], rows)


@hydra.main(config_path=str(CONF_DIR), config_name="compare", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Command line: compare, then print the markdown table."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    command = " ".join(["python eval/compare.py", *(
        [f"--config-name {hc.job.config_name}"] if hc.job.config_name != "compare" else []),
        *map(shlex.quote, hc.overrides.task)])
    result = run(cfg, command=command)
    print("\n".join(markdown(result, cfg)))


if __name__ == "__main__":
    main()
