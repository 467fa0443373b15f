"""The fallback bound of ``scripts/bench.py``: decode.py's defaults against plain decoding on a
draft whose proposals are useless.

Per prompt, plain decoding, the draft at a fixed K and decode.py's defaults (K from
``speculation.json``, adaptive K, fallback to plain decoding) run back to back, ``repeats``
rounds, with plain decoding once more at the end (:func:`eval.session.paired_many`), so that the
machine's drift over minutes cancels in each prompt's ratio (the paired speedup of
:mod:`eval.speedup`: median over rounds of each, then the ratio; median and minimum over prompts
are reported). ``useless-<family>`` is that family's package with its LM-head rows shifted by one
token id: a draft at the real cost whose proposals are wrong, the case the fallback must bound.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.eval import decode, session
from draftsmith.eval.draft import build_proposer, load_draft, resolve_k, settle
from draftsmith.eval.markdown import table
from draftsmith.heads.family import FAMILIES
from draftsmith.scripts.bench_drafts import draft_paths, package_k
from draftsmith.scripts.tooling import note

USELESS = "useless-"  # fallback_bound.drafts: useless-<family> = that package, proposals shifted


def useless_copy(fam: str, lm_path: str, loaded: Any, out_dir: Path) -> str:
    """A draft LM package whose proposals are useless at the same cost: the lm package with its
    LM-head rows shifted by one token id (untied from the input embeddings, which stay as they
    were), so that it always proposes the neighbour of what it would have proposed. It measures
    the fallback bound: on such a draft, decode.py's defaults must stay close to plain decoding."""
    from draftsmith.heads.package import save_package

    pkg = load_draft(lm_path, loaded)
    head = pkg.module.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().roll(1, dims=0).clone())
    pkg.module.config.tie_word_embeddings = False
    out = out_dir / f"{USELESS}{fam}"
    save_package(out, fam, pkg.module, pkg.head_config, pkg.identity)
    return str(out)


def _draft_path(name: str, given: dict[str, str], loaded: Any, tmp: Path) -> str | None:
    """The package ``fallback_bound.drafts`` names by ``name`` (a useless copy made in ``tmp``),
    or None when its family's package was not given."""
    assistants = [f"{USELESS}{f.name}" for f in FAMILIES.values() if f.hf_model]
    useless = name in assistants
    fam = name.removeprefix(USELESS) if useless else name
    if fam not in FAMILIES:
        raise ValueError(f"fallback_bound.drafts: unknown {name!r}; allowed "
                         f"{', '.join([*assistants, *FAMILIES])}")
    if fam not in given:
        note("bench", f"fallback bound: no {fam} package, skipping {name}")
        return None
    return useless_copy(fam, given[fam], loaded, tmp) if useless else given[fam]


def bench_fallback(cfg: DictConfig, loaded: Any, records: list[dict]) -> list[dict]:
    """decode.py's defaults and the draft at a fixed K against plain decoding, per draft of
    ``fallback_bound.drafts`` and temperature (see the module docstring)."""
    fb = cfg.fallback_bound
    given = draft_paths(cfg)
    model = loaded.model
    eos = session.eos_ids(model)
    plain = session.plain_decoder(model, records)
    chain = OmegaConf.merge(OmegaConf.load(decode.CONF_FILE),
                            {"tree": "chain", "dtype": cfg.dtype, "device": cfg.device})
    out = []
    with tempfile.TemporaryDirectory(prefix="bench-useless-") as tmp:
        for name in map(str, fb.drafts):
            path = _draft_path(name, given, loaded, Path(tmp))
            if path is None:
                continue
            pkg = load_draft(path, loaded)
            proposer = build_proposer(pkg, settle(chain, pkg, measured=False), loaded,
                                      int(model.config.vocab_size), cfg.device, cfg.dtype)
            k_fixed, _ = package_k(path, cfg.k, cfg.dtype, cfg.device)
            k_auto, auto_src = resolve_k(None, pkg.speculation, cfg.dtype, cfg.device)
            decs = [session.decoder(model, proposer, records, k=k_fixed, adaptive=False,
                                    fallback=False),
                    session.decoder(model, proposer, records, k=k_auto)]
            for t in [float(x) for x in cfg.temperatures]:
                note("bench", f"T={t}: fallback bound, {name} (plain / K={k_fixed} / defaults, "
                              "interleaved)")
                sampling = session.Sampling(int(cfg.max_new_tokens), t, seed=int(cfg.seed))
                fixed, defaults = session.paired_many(decs, model, records, sampling, eos,
                                                      plain=plain, rounds=int(fb.repeats))
                merged = defaults.stats
                out.append({"draft": name, "temperature": t, "k_fixed": k_fixed,
                            "k_defaults": k_auto, "k_defaults_source": auto_src,
                            "repeats": int(fb.repeats), "n_prompts": len(records),
                            "plain_tokens_per_s": defaults.baseline_tokens_per_s,
                            "fixed_vs_plain": fixed.speedup,
                            "fixed_vs_plain_min": _worst(fixed),
                            "defaults_vs_plain": defaults.speedup,
                            "defaults_vs_plain_min": _worst(defaults),
                            "defaults_tau": merged.tau,
                            "defaults_spec_step_share": merged.spec_steps / max(
                                merged.spec_steps + merged.plain_steps, 1),
                            "per_prompt_defaults_vs_plain": defaults.ratios})
    return out


def _worst(res: session.Paired) -> float | None:
    """The smallest per-prompt ratio."""
    return res.speedup_spread[0] if res.speedup_spread else None


def fallback_markdown(rows: list[dict]) -> list[str]:
    """The fallback bound's section of ``results.md``."""
    return ["", "## Fallback bound", "",
            (f"Per prompt, plain decoding, the draft at a fixed K and decode.py's defaults "
             f"(adaptive K + fallback to plain) ran back to back, {rows[0]['repeats']} rounds "
             "(plain decoding once more at the end); ratio of per-prompt medians to plain, "
             "median and minimum over prompts. useless-lm: the lm package with its LM-head "
             "rows shifted by one token id."), ""] + table(
        ["T", "draft", "fixed K", "fixed K vs plain (min)", "defaults K",
         "defaults vs plain (min)", "defaults tau", "speculative steps"],
        [[f"{r['temperature']:g}", r["draft"], r["k_fixed"],
          f"{r['fixed_vs_plain']:.2f}x ({r['fixed_vs_plain_min']:.2f}x)",
          f"{r['k_defaults']} ({r['k_defaults_source']})",
          f"{r['defaults_vs_plain']:.2f}x ({r['defaults_vs_plain_min']:.2f}x)",
          f"{r['defaults_tau']:.2f}", f"{r['defaults_spec_step_share']:.0%}"] for r in rows])
