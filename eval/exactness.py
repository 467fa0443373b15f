"""Greedy exactness check: every proposer must reproduce the target's own greedy output.

    python eval/exactness.py drafts=[DIR,...] prompts=[humaneval,sharegpt] per_set=25 \
        max_new_tokens=128 out=exactness.json

The reference output of each prompt is computed once with transformers ``generate``
(``do_sample=False``, same model and dtype, chat template with the generation prompt, the target's
EOS ids). Every prompt is then decoded at temperature 0 through :class:`SpeculativeDecoder` with
plain decoding (K = 0), prompt lookup, the suffix proposer and, per draft package, its proposers
(draft LM chain, Medusa tree, EAGLE chain and EAGLE dynamic tree), each also beside the suffix
proposer: both proposals merged into one tree every round (``suffix_modes=[merge]``) and the
per-round choice decode.py makes (``auto``). ``only=[names]`` checks some of them (a full
name, ``eagle-tree@DRAFT``, or the part before ``@`` for every draft). With
``drafts=[]`` untrained stand-ins are built in-process (a draft LM copied from target layers,
fresh Medusa heads, a fresh EAGLE head): greedy exactness does not depend on draft quality.

Where an output differs, the report gives the first divergence index and the target's top-2 logit
gap at that position from a plain full forward (no cache) of the prompt and the reference prefix;
a gap below ``tie_gap`` is a *numerical tie* (batched and incremental forwards may legitimately
order two near-equal logits differently). The run fails (exit code 1) when any proposer reproduces
fewer than ``min_fraction`` of the prompts or diverges anywhere that is not a tie.
"""
from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from draftsmith.eval import CONF_DIR, session
from draftsmith.eval.decode import DTYPES
from draftsmith.eval.decoding.proposers import PlainProposer, PromptLookupProposer, Proposer
from draftsmith.eval.decoding.proposers_suffix import SUFFIX_MODES, SuffixProposer
from draftsmith.eval.decoding.stats import DecodeStats
from draftsmith.eval.draft import build_proposer, load_draft, parse_draft_vocab, settle
from draftsmith.eval.machine import environment
from draftsmith.heads.family import get_family
from draftsmith.heads.family_base import TreeKind

# decode.py ``tree=`` modes checked per tree kind: a dynamic tree drafts chains too
TREE_MODES = {TreeKind.DYNAMIC: ("chain", "tree"), TreeKind.STATIC: ("tree",),
              TreeKind.NONE: ("chain",)}


# ----------------------------------------------------------------------------- tie logic
def first_divergence(reference: Sequence[int], output: Sequence[int]) -> int | None:
    """Index of the first differing token, ``None`` when identical.

    When one sequence is a strict prefix of the other the index is the shorter one's length.
    """
    ref, out = list(reference), list(output)
    if ref == out:
        return None
    for i, (a, b) in enumerate(zip(ref, out)):
        if a != b:
            return i
    return min(len(ref), len(out))


@torch.inference_mode()
def top2_gap(model: torch.nn.Module, ids: Sequence[int]) -> tuple[float, int, int]:
    """The target's next-token top-2 logit gap after ``ids`` from one full forward (no cache).

    Args:
        model: a HF causal LM.
        ids: ``(T,)`` token ids (prompt plus reference prefix), ``T >= 1``.

    Returns:
        ``(gap, top1_id, top2_id)`` with ``gap = logit[top1] - logit[top2] >= 0`` (in fp32).
    """
    if len(ids) == 0:
        raise ValueError("top2_gap needs at least one token to condition on")
    device = next(model.parameters()).device
    x = torch.tensor([list(ids)], dtype=torch.long, device=device)  # (1, T)
    logits = model(input_ids=x, use_cache=False).logits[0, -1].float()  # (V,)
    top = torch.topk(logits, 2)
    return float(top.values[0] - top.values[1]), int(top.indices[0]), int(top.indices[1])


def diagnose(model: torch.nn.Module, prompt: Sequence[int], reference: Sequence[int],
             output: Sequence[int], tie_gap: float,
             memo: dict[tuple[int, ...], tuple[float, int, int]] | None = None) -> dict | None:
    """Describe how ``output`` departs from ``reference`` (``None`` when identical).

    A divergence is a numerical tie when the target's top-2 logit gap after the reference prefix
    is below ``tie_gap`` *and* the two differing tokens are exactly those top-2 tokens (picking a
    lower-ranked token is never a tie).

    Args:
        model: the target (a HF causal LM).
        prompt: ``(T,)`` prompt ids.
        reference: the target's greedy continuation.
        output: the continuation under test.
        tie_gap: logit gap below which the top-2 tokens count as tied.
        memo: optional cache of :func:`top2_gap` results keyed by the full prefix.

    Returns:
        ``{"index", "reference_token", "output_token", "top2_gap", "top2", "tie"}``;
        ``top2_gap`` is ``None`` (never a tie) when the outputs differ only by the reference
        stopping early, where no reference prefix explains the extra tokens.
    """
    index = first_divergence(reference, output)
    if index is None:
        return None
    ref_tok = int(reference[index]) if index < len(reference) else None
    out_tok = int(output[index]) if index < len(output) else None
    info: dict[str, Any] = {"index": index, "reference_token": ref_tok, "output_token": out_tok,
                            "top2_gap": None, "top2": None, "tie": False}
    if ref_tok is None:
        return info
    prefix = tuple(int(t) for t in prompt) + tuple(int(t) for t in reference[:index])
    if memo is not None and prefix in memo:
        gap, t1, t2 = memo[prefix]
    else:
        gap, t1, t2 = top2_gap(model, prefix)
        if memo is not None:
            memo[prefix] = (gap, t1, t2)
    info.update(top2_gap=gap, top2=[t1, t2],
                tie=bool(gap < tie_gap and out_tok is not None and {ref_tok, out_tok} <= {t1, t2}))
    return info


# ----------------------------------------------------------------------------- reference
@torch.inference_mode()
def reference_greedy(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int,
                     eos: int | list[int] | None, pad: int | None) -> list[int]:
    """The target's own greedy continuation from transformers ``generate`` (new tokens only)."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)  # (1, T)
    first_eos = eos[0] if isinstance(eos, list) and eos else eos
    gen = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=int(max_new_tokens),
                           eos_token_id=eos, pad_token_id=pad if pad is not None else first_eos)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return [int(t) for t in out[0, ids.shape[1]:].tolist()]


# ----------------------------------------------------------------------------- proposers
def standin_packages(cfg: DictConfig, model: torch.nn.Module) -> list[Any]:
    """Untrained stand-ins of every family in ``cfg.standins`` (head config values), as
    package-like objects."""
    from types import SimpleNamespace

    torch.manual_seed(int(cfg.seed))
    out = []
    for name, raw in OmegaConf.to_container(cfg.standins, resolve=True).items():
        family = get_family(name)
        head_cfg = family.head_config(raw, model.config)
        out.append(SimpleNamespace(family=family, head_config=head_cfg,
                                   module=family.build(head_cfg, model).eval(), name="untrained",
                                   speculation=None, path=None))
    return out


def build_proposers(cfg: DictConfig, loaded: Any) -> list[tuple[str, Proposer]]:
    """``(name, proposer)`` for plain, prompt lookup and every draft (or the stand-ins)."""
    model = loaded.model
    vocab = int(model.config.vocab_size)
    out: list[tuple[str, Proposer]] = [("plain", PlainProposer()),
                                       ("lookup", PromptLookupProposer()),
                                       ("suffix", SuffixProposer())]
    drafts = _as_list(cfg.drafts)
    pkgs = []
    for d in drafts:
        pkg = load_draft(d, loaded)
        pkgs.append((pkg, Path(d).expanduser().name or d))
    if not drafts:
        pkgs = [(p, p.name) for p in standin_packages(cfg, model)]
    for pkg, name in pkgs:
        family = pkg.family
        # the whole vocabulary, and (draft_vocab=N, draft LM / EAGLE) its N most frequent ids
        vocabs = [None]
        if parse_draft_vocab(cfg.draft_vocab) is not None and family.draft_vocab:
            vocabs.append(parse_draft_vocab(cfg.draft_vocab))
        for tree, size in itertools.product(TREE_MODES[family.tree], vocabs):
            options = {"device": cfg.device, "dtype": cfg.dtype, "tree": tree,
                       "tree_topk": cfg.tree_topk, "tree_size": cfg.tree_size,
                       "draft_vocab": size, "medusa_branching": list(cfg.medusa_branching)}
            plan = settle(options, pkg, measured=False)
            proposer = build_proposer(pkg, plan, loaded, vocab, cfg.device, cfg.dtype)
            label = f"{family.name}-{tree}{f'/{size}ids' if size else ''}"
            out.append((f"{label}@{name}", proposer))
            for mode in _hybrid_modes(cfg) if size is None else ():  # beside the suffix
                tag = "+suffix" if mode == "merge" else f"+suffix-{mode}"
                out.append((f"{label}{tag}@{name}",
                            SuffixProposer(build_proposer(pkg, plan, loaded, vocab, cfg.device,
                                                          cfg.dtype), vocab, mode=mode)))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"two drafts share a folder name ({names}); give folders distinct names")
    only = _as_list(cfg.get("only"))
    selectors = {n: {n, n.split("@")[0]} for n in names}  # a full name, or its family part
    unknown = [o for o in only if not any(o in sel for sel in selectors.values())]
    if unknown:
        raise ValueError(f"only={only}: {unknown} name no proposer of this run; the names are "
                         f"{names} (the part before @ selects it for every draft)")
    return [(n, p) for n, p in out if not only or selectors[n] & set(only)]


def _hybrid_modes(cfg: DictConfig) -> list[str]:
    """The hybrids checked per draft (``suffix_modes``; none with ``suffix=false``)."""
    if not cfg.get("suffix", True):
        return []
    modes = _as_list(cfg.get("suffix_modes", ["merge"]))
    bad = [m for m in modes if m not in SUFFIX_MODES]
    if bad:
        raise ValueError(f"suffix_modes={modes}: allowed {list(SUFFIX_MODES)}")
    return modes


# ----------------------------------------------------------------------------- run
def _validate(cfg: DictConfig) -> None:
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype={cfg.dtype!r}: allowed {DTYPES}")
    for key in ("per_set", "max_new_tokens", "k"):
        if int(cfg[key]) < 1:
            raise ValueError(f"{key} must be >= 1, got {cfg[key]}")
    if not 0.0 <= float(cfg.min_fraction) <= 1.0:
        raise ValueError(f"min_fraction must lie in [0, 1], got {cfg.min_fraction}")
    if float(cfg.tie_gap) < 0:
        raise ValueError(f"tie_gap must be >= 0, got {cfg.tie_gap}")


def _as_list(value: Any) -> list[str]:
    """A Hydra value given as one item or a list, as a list of strings."""
    if value is None:
        return []
    if isinstance(value, (list, tuple, ListConfig)):
        return [str(v) for v in value]
    return [str(value)]


def _prompt_sets(cfg: DictConfig) -> list[str]:
    sets = _as_list(cfg.prompts)
    if not sets:
        raise ValueError("prompts is empty: give one or more sets, "
                         "e.g. prompts=[humaneval,sharegpt]")
    return sets


def _check_proposer(name: str, proposer: Proposer, model: torch.nn.Module, records: list[dict],
                    refs: dict[str, list[int]], cfg: DictConfig, eos: Any,
                    memo: dict[tuple[int, ...], tuple[float, int, int]]) -> dict:
    """Decode every record with one proposer and compare with the references."""
    k = 0 if type(proposer) is PlainProposer else int(cfg.k)
    dec = session.decoder(model, proposer, k=k, k_max=cfg.k_max, adaptive=bool(cfg.adaptive_k),
                          fallback=bool(cfg.fallback))
    divergences, parts = [], []
    for rec in records:
        res = dec.generate(rec["prompt_ids"], int(cfg.max_new_tokens), 0.0, eos_token_id=eos)
        parts.append(res.stats)
        info = diagnose(model, rec["prompt_ids"], refs[rec["key"]], res.output_ids,
                        float(cfg.tie_gap), memo)
        if info is not None:
            divergences.append({"id": rec["id"], "set": rec["set"], **info})
    stats = DecodeStats.merge(parts)
    total = len(records)
    identical = total - len(divergences)
    return {"identical": identical, "total": total, "fraction": identical / total,
            "ties": sum(d["tie"] for d in divergences),
            "non_ties": sum(not d["tie"] for d in divergences), "divergences": divergences,
            "tau": stats.tau, "acceptance_rate": stats.acceptance_rate,
            "wall_time_s": stats.wall_time_s, "lossless": dec.lossless}


def failures(result: dict, min_fraction: float) -> list[str]:
    """Reasons the check fails (empty when it passes)."""
    bad = []
    for name, r in result["proposers"].items():
        if r["fraction"] < min_fraction:
            bad.append(f"{name}: {r['identical']}/{r['total']} identical "
                       f"({r['fraction']:.3f} < min_fraction {min_fraction})")
        if r["non_ties"]:
            first = next(d for d in r["divergences"] if not d["tie"])
            bad.append(f"{name}: {r['non_ties']} divergence(s) that are not numerical ties "
                       f"(first: {first['set']}:{first['id']} at token {first['index']}, "
                       f"top-2 gap {first['top2_gap']})")
    return bad


def run(cfg: DictConfig, loaded: Any = None) -> dict:
    """Run the check; returns the report dict (also written to ``cfg.out``).

    Args:
        cfg: the ``conf/eval/exactness.yaml`` keys.
        loaded: an already loaded ``LoadedTarget`` (else loaded from ``cfg.target_path``).
    """
    _validate(cfg)
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    try:
        return _run(cfg, loaded)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: DictConfig, loaded: Any) -> dict:
    sets = _prompt_sets(cfg)
    loaded = session.open_target(cfg, loaded)
    model, tok = loaded.model, loaded.tokenizer
    records = []
    for s in sets:
        for rec in session.prompt_records(s, tok, int(cfg.per_set)):
            records.append({**rec, "set": s, "key": f"{s}:{rec['id']}"})
    if not records:
        raise ValueError(f"no prompts loaded from prompts={sets} (per_set={cfg.per_set})")
    if len({r["key"] for r in records}) != len(records):
        raise ValueError(f"prompt ids repeat within prompts={sets}: list each set once")
    eos = session.eos_ids(model)
    pad = getattr(tok, "pad_token_id", None)

    t0 = time.perf_counter()
    refs = {r["key"]: reference_greedy(model, r["prompt_ids"], int(cfg.max_new_tokens), eos, pad)
            for r in records}
    ref_time = time.perf_counter() - t0
    memo: dict[tuple[int, ...], tuple[float, int, int]] = {}
    proposers = {}
    for name, proposer in build_proposers(cfg, loaded):
        proposers[name] = _check_proposer(name, proposer, model, records, refs, cfg, eos, memo)
    settings = OmegaConf.to_container(cfg, resolve=True)
    settings.pop("hydra", None)
    result: dict[str, Any] = {
        "settings": {**settings, "prompt_sets": sets},
        **environment(cfg.device),
        "target": loaded.identity.to_dict() if hasattr(loaded.identity, "to_dict") else None,
        "reference_time_s": ref_time,
        "proposers": proposers,
        "references": {r["key"]: refs[r["key"]] for r in records},
    }
    result["failures"] = failures(result, float(cfg.min_fraction))
    result["passed"] = not result["failures"]
    if cfg.out:
        out = Path(str(cfg.out)).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    return result


def print_table(result: dict) -> None:
    """A rich table: one row per proposer."""
    from rich.console import Console
    from rich.table import Table

    s = result["settings"]
    table = Table(title=f"greedy exactness: {s['prompt_sets']} x {s['per_set']} prompts, "
                        f"{s['max_new_tokens']} new tokens, {s['dtype']} on {s['device']}")
    for col in ("proposer", "identical", "fraction", "ties", "non-ties", "tau", "time s", "status"):
        table.add_column(col, justify="left" if col == "proposer" else "right")
    min_fraction = float(s["min_fraction"])
    for name, r in result["proposers"].items():
        ok = r["fraction"] >= min_fraction and not r["non_ties"]
        table.add_row(name, f"{r['identical']}/{r['total']}", f"{r['fraction']:.3f}",
                      str(r["ties"]), str(r["non_ties"]), f"{r['tau']:.2f}",
                      f"{r['wall_time_s']:.1f}", "[green]ok" if ok else "[red]FAIL")
    console = Console()
    console.print(table)
    for line in result["failures"]:
        console.print(f"[red]FAIL[/red] {line}")


def run_overrides(overrides: list[str], loaded: Any = None) -> dict:
    """Run with Hydra override strings in-process (tests, scripts)."""
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra.compose(config_name="exactness", overrides=list(overrides))
    return run(cfg, loaded)


_EXIT: list[int] = []


@hydra.main(config_path=str(CONF_DIR), config_name="exactness", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    result = run(cfg)
    print_table(result)
    _EXIT.append(0 if result["passed"] else 1)


def main() -> int:
    """CLI entry point; returns the exit code (1 when the check fails)."""
    _main()
    return _EXIT[-1] if _EXIT else 1


if __name__ == "__main__":
    sys.exit(main())
