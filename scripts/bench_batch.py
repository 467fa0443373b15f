"""Throughput against batch size: plain batched decoding, transformers' batched ``generate`` and
batched speculation with each draft at every K, in ONE run.

    python scripts/bench_batch.py                      # the released EAGLE head
    python scripts/bench_batch.py lm=outputs/lm_quick/draft write=true

For each batch size B the first B prompts decode together; per round the methods run back to
back (plain, transformers, every draft at every K, plain again), ``repeats`` rounds, and a
method's speedup is the median over rounds of its tokens/s (all rows' new tokens over the
batch's wall time) over the mean of that round's two plain runs. K*(B) is the K of the best
speedup, 0 when none beats plain decoding; the *crossover* is the smallest B with K* = 0.
``write=true`` stores ``{"k_star": {B: K*}, "crossover": ..., "speedup": ...}`` as
``speculation.json["batch"]`` of each draft package (re-signed with the local key), where
``eval/decode.py batch_size=B`` reads its K.

``tree=true`` adds the EAGLE head's dynamic tree at the package's measured shape (depth and
nodes of its tree record; ``tree_shapes=[[depth, nodes], ...]`` for others), each row its own
tree, to the table; the batch record keeps the best tree per batch size and whether it beat
the best chain and plain decoding there (``eval/decode.py batch_size=B`` drafts it then).

Heterogeneous rows (``scripts/bench_mixed.py``): one batch of a well-drafted prompt and a row
whose drafts are always wrong (every draft token shifted by one id: a useless draft for that row
alone, at the same cost), against each good row decoded alone at the same K. Writes
``results.json``, ``results.md`` and ``throughput.png`` under ``out_dir``.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.data.dtype import resolve_dtype
from draftsmith.data.prompts import check_prompt_set
from draftsmith.eval import decode, session
from draftsmith.eval.checks import check_out_dir, check_sampling, integer
from draftsmith.eval.decoding.batch import BatchDecoder
from draftsmith.eval.decoding.proposers import PlainProposer
from draftsmith.eval.draft import build_proposer, load_draft, settle
from draftsmith.eval.machine import environment
from draftsmith.eval.markdown import table, write_markdown
from draftsmith.eval.speedup import paired_speedup
from draftsmith.heads.family import FAMILIES
from draftsmith.scripts.bench_mixed import bench_mixed, mixed_markdown
from draftsmith.scripts.tooling import note, repo_path

CONF_FILE = decode.CONF_DIR / "bench_batch.yaml"
TOOL = "bench-batch"  # the tag of its progress lines


def hf_batched(model: Any, tok: Any, prompts: list[list[int]], max_new: int,
               eos: Any) -> int:
    """transformers ``generate`` on the batch (left padding, greedy); new tokens up to each
    row's EOS."""
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device),
                         max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                         pad_token_id=pad)[:, width:]
    ends = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    total = 0
    for row in out.tolist():
        n = next((i + 1 for i, t in enumerate(row) if t in ends), len(row))
        total += n
    return total


def timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _validate(cfg: DictConfig) -> tuple[Path, list[int], list[int], list, int, dict[str, str]]:
    """Every setting and ``out_dir`` (not an input), before the target loads: the questions,
    batch sizes, Ks, tree shapes, good rows of the heterogeneous test and the draft packages
    given."""
    questions = repo_path(cfg.questions)
    check_prompt_set(questions)
    sizes = [integer("batch_sizes", b, "integers >= 1") for b in cfg.batch_sizes]
    ks = [integer("ks", k, "integers >= 1") for k in cfg.ks]
    if min(sizes) < 1 or min(ks) < 1:
        raise ValueError(f"batch_sizes and ks must be >= 1, got {sizes}, {ks}")
    check_sampling(cfg.temperature)
    shapes = tree_shapes(cfg)
    good_rows = integer("mixed.good_rows", cfg.mixed.good_rows, "an integer >= 1")
    if cfg.mixed.enabled and good_rows < 1:
        raise ValueError(f"mixed.good_rows={good_rows}: the heterogeneous-row test needs at least "
                         "one good row beside the hostile one (or mixed.enabled=false)")
    if cfg.mixed.enabled and str(cfg.mixed.k) == "auto":
        if not {1, good_rows + 1} <= set(sizes):
            raise ValueError(f"mixed.k=auto takes K from this run's table at B = 1 and B = "
                             f"mixed.good_rows + 1 = {good_rows + 1}: add them to batch_sizes "
                             f"(got {sizes}) or pass mixed.k=<an integer>")
    elif cfg.mixed.enabled and integer("mixed.k", cfg.mixed.k, "auto or an integer >= 1") < 1:
        raise ValueError(f"mixed.k must be auto or an integer >= 1, got {cfg.mixed.k}")
    drafts = {f: str(repo_path(cfg[f])) for f in FAMILIES if cfg.get(f)}  # lm=, eagle=
    check_out_dir("out_dir", repo_path(cfg.out_dir), {"questions": questions, **{
        f: Path(p) for f, p in drafts.items()}}, ("results.json", "results.md"))
    return questions, sizes, ks, shapes, good_rows, drafts


@dataclass
class _Decoders:
    """The batched decoders of a run: plain, every draft at every K, the measured trees."""

    proposers: dict[str, Any]  # family -> its chain proposer
    plain: BatchDecoder
    decs: dict[str, BatchDecoder]  # method label -> decoder
    trees: dict[str, dict[str, tuple[int, int]]]  # family -> label -> (depth, nodes)


def _decoders(cfg: DictConfig, loaded: Any, drafts: dict[str, str], ks: list[int],
              shapes: list[tuple[int, int] | None]) -> _Decoders:
    model = loaded.model
    chain = OmegaConf.merge(OmegaConf.load(decode.CONF_FILE),
                            {"tree": "chain", "dtype": cfg.dtype, "device": cfg.device})
    proposers, pkgs = {}, {}
    for fam, path in drafts.items():
        pkg = pkgs[fam] = load_draft(path, loaded)
        proposers[fam] = build_proposer(pkg, settle(chain, pkg), loaded,
                                        int(model.config.vocab_size), cfg.device, cfg.dtype)
    plain = BatchDecoder(model, PlainProposer(), k=0)
    decs = {f"{fam} K={k}": BatchDecoder(model, p, k=k, fallback=False)
            for fam, p in proposers.items() for k in ks}
    trees: dict[str, dict[str, tuple[int, int]]] = {}
    for fam in [f for f in drafts if cfg.get("tree") and FAMILIES[f].batched_tree]:
        pkg = pkgs[fam]
        for shape in shapes:  # the package's measured shape, or the shapes given
            over = {"tree": "tree"} if shape is None else {"tree": "tree", "k": shape[0],
                                                           "tree_size": shape[1]}
            plan = settle(OmegaConf.merge(chain, over), pkg)
            tree = build_proposer(pkg, plan, loaded, int(model.config.vocab_size), cfg.device,
                                  cfg.dtype)
            label = f"{fam} tree ({plan.k} deep, {plan.tree_size} nodes)"
            decs[label] = BatchDecoder(model, tree, k=plan.k, fallback=False)
            trees.setdefault(fam, {})[label] = (plan.k, plan.tree_size)
    return _Decoders(proposers, plain, decs, trees)


def _throughput(cfg: DictConfig, loaded: Any, records: list[dict], sizes: list[int],
                decoders: _Decoders, eos: Any) -> list[dict]:
    """Per batch size, every method's tokens/s and its speedup over plain batched decoding
    (the paired speedup over rounds: each round's tokens/s over the mean of its two plain
    runs, median over rounds)."""
    model, tok = loaded.model, loaded.tokenizer
    max_new, temp = int(cfg.max_new_tokens), float(cfg.temperature)
    plain, decs = decoders.plain, decoders.decs

    def ours(dec: BatchDecoder, prompts: list[list[int]], seed: int) -> float:
        res, wall = timed(lambda: dec.generate(prompts, max_new, temp, eos_token_id=eos,
                                               seed=seed))
        return sum(len(r.output_ids) for r in res) / wall

    for d in (plain, *decs.values()):  # warm-up
        d.generate([records[0]["prompt_ids"]], 2, seed=0)
    rows = []
    for b in sizes:
        prompts = [r["prompt_ids"] for r in records[:b]]
        tps: dict[str, list[float]] = {}
        bases = []
        for rnd in range(int(cfg.repeats)):
            note(TOOL, f"batch {b}, round {rnd + 1}")
            base = [ours(plain, prompts, rnd)]
            got = {}
            if cfg.hf_generate and temp == 0:
                n_hf, w_hf = timed(lambda p=prompts: hf_batched(model, tok, p, max_new, eos))
                got["transformers generate"] = n_hf / w_hf
            for label, dec in decs.items():
                got[label] = ours(dec, prompts, rnd)
            base.append(ours(plain, prompts, rnd))
            bases.append(base)
            tps.setdefault("plain", []).extend(base)
            for m, v in got.items():
                tps.setdefault(m, []).append(v)
        rows.append({"batch_size": b,
                     "tokens_per_s": {m: statistics.median(v) for m, v in tps.items()},
                     "speedup": {m: paired_speedup(v, bases).median
                                 for m, v in tps.items() if m != "plain"}})
    return rows


def _batch_records(cfg: DictConfig, rows: list[dict], decoders: _Decoders,
                   ks: list[int]) -> dict[str, dict]:
    """Per family, what ``speculation.json["batch"]`` records: K* and speedup per batch size,
    the crossover, and the best tree per batch size."""
    records = {}
    for fam in decoders.proposers:
        k_star, speedup = {}, {}
        for r in rows:
            best = best_k(r, fam, ks)
            sp = r["speedup"][f"{fam} K={best}"]
            k_star[str(r["batch_size"])] = best if sp > 1.0 else 0
            speedup[str(r["batch_size"])] = sp
        cross = next((int(b) for b, k in k_star.items() if k == 0), None)
        records[fam] = {"k_star": k_star, "speedup": speedup, "crossover": cross,
                        "dtype": cfg.dtype, "device": str(cfg.device),
                        "max_new_tokens": int(cfg.max_new_tokens),
                        "temperature": float(cfg.temperature),
                        "command": "python scripts/bench_batch.py " + " ".join(sys.argv[1:])}
        if fam in decoders.trees:  # the best tree per batch size, and whether it won there
            records[fam]["tree"] = best_trees(rows, fam, decoders.trees[fam], ks)
    return records


def run(cfg: DictConfig) -> dict:
    from draftsmith.data.target import load_target

    questions, sizes, ks, shapes, good_rows, drafts = _validate(cfg)
    t_start = time.perf_counter()
    cfg.dtype = resolve_dtype(cfg.dtype, str(cfg.device))
    loaded = load_target(cfg.target_path, dtype=getattr(torch, cfg.dtype))
    model = loaded.model.to(cfg.device).eval()
    # the mixed test decodes good_rows questions and one more (the hostile row's prompt)
    need = max(*sizes, good_rows + 1 if cfg.mixed.enabled else 1)
    records = session.prompt_records(str(questions), loaded.tokenizer, need)
    if len(records) < need:
        raise ValueError(f"{questions} has {len(records)} questions but batch_sizes={sizes} and "
                         f"mixed.good_rows={good_rows} need {need}: lower them or pass a longer "
                         "questions= file")
    eos = session.eos_ids(model)
    decoders = _decoders(cfg, loaded, drafts, ks, shapes)
    rows = _throughput(cfg, loaded, records, sizes, decoders, eos)
    batch_records = _batch_records(cfg, rows, decoders, ks)
    proposers = decoders.proposers
    # the hostile row shifts its drafts but not their q: lossless only for greedy rows
    mixed_ks = ({fam: mixed_k(cfg, rows, ks, fam) for fam in proposers}
                if cfg.mixed.enabled else {})
    mixed = (bench_mixed(cfg, model, proposers, records, eos, mixed_ks)
             if cfg.mixed.enabled and float(cfg.temperature) == 0 else [])
    res = {"config": OmegaConf.to_container(cfg, resolve=True), "rows": rows,
           "batch": batch_records, "mixed": mixed, "target": loaded.identity.to_dict(),
           "environment": environment(cfg.device), "bench_wall_s": time.perf_counter() - t_start,
           "command": "python scripts/bench_batch.py " + " ".join(sys.argv[1:])}
    out = repo_path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    write_markdown(out / "results.md", results_markdown(res))
    plot(res, out / "throughput.png")
    if cfg.write:
        from draftsmith.heads.package import update_package_json

        for fam, path in drafts.items():
            spec = json.loads((Path(path) / "speculation.json").read_text()) if (
                Path(path) / "speculation.json").is_file() else {}
            spec["batch"] = batch_records[fam]
            update_package_json(path, "speculation.json", spec)
            note(TOOL, f"wrote the batch record into {path}/speculation.json")
    return res


def tree_shapes(cfg: DictConfig) -> list[tuple[int, int] | None]:
    """``tree_shapes`` as ``(depth, nodes)`` pairs; ``[None]`` (the package's measured tree)
    when null. A bad entry is refused naming the form."""
    if cfg.get("tree_shapes") is None:
        return [None]
    shapes = []
    for s in cfg.tree_shapes:
        ok = (not isinstance(s, (str, int)) and len(s) == 2
              and all(isinstance(x, int) and x >= 1 for x in s))
        if not ok:
            raise ValueError(f"tree_shapes entry {s!r}: each is [depth, nodes], both integers "
                             '>= 1, e.g. "tree_shapes=[[4,16],[2,4]]"; or null for the '
                             "package's measured tree")
        shapes.append((int(s[0]), int(s[1])))
    return shapes


def mixed_k(cfg: DictConfig, rows: list[dict], ks: list[int], fam: str) -> tuple[int, int]:
    """The K of the heterogeneous test, alone and batched: ``mixed.k``, or with ``auto`` the
    best K of this run's table at B = 1 and at B = ``good_rows + 1`` (what ``eval/decode.py
    batch_size=B`` reads from the batch record), so each side runs at the K it would use."""
    if str(cfg.mixed.k) != "auto":
        return int(cfg.mixed.k), int(cfg.mixed.k)
    by_b = {r["batch_size"]: r for r in rows}
    return best_k(by_b[1], fam, ks), best_k(by_b[int(cfg.mixed.good_rows) + 1], fam, ks)


def best_trees(rows: list[dict], fam: str, trees: dict[str, tuple[int, int]],
               ks: list[int]) -> dict[str, dict]:
    """Per batch size, the best of ``fam``'s measured ``trees`` (label -> depth, nodes) and
    whether it beat ``fam``'s best chain and plain decoding there (``eval/draft.py`` then
    drafts it with ``tree=auto``)."""
    out = {}
    for r in rows:
        label = max(trees, key=lambda m: r["speedup"][m])
        sp = r["speedup"][label]
        chain = r["speedup"][f"{fam} K={best_k(r, fam, ks)}"]
        out[str(r["batch_size"])] = {"depth": trees[label][0], "nodes": trees[label][1],
                                     "speedup": sp, "wins": sp > max(chain, 1.0)}
    return out


def best_k(row: dict, fam: str, ks: list[int]) -> int:
    """The K of the best speedup of ``fam`` in one batch size's ``row`` of the table."""
    return max(ks, key=lambda k: row["speedup"][f"{fam} K={k}"])


def results_markdown(res: dict) -> list[str]:
    """``results.md``'s lines: the throughput table, the batch records and the heterogeneous
    rows."""
    env = res["environment"]
    methods = list(res["rows"][0]["tokens_per_s"])
    cfg = res["config"]
    head = (f"`{res['command']}`; {env.get('hardware', {}).get('cpu', '')}, {cfg['dtype']}, "
            f"{cfg['max_new_tokens']} new tokens per row, T = {cfg['temperature']}, "
            f"{cfg['repeats']} rounds; {res['bench_wall_s']:.0f} s.")
    lines = ["# Throughput against batch size", "", head, "",
             "Tokens/s (all rows) and, in brackets, speedup over plain batched decoding:", ""]
    lines += table(["B", *methods],
                   [[r["batch_size"], *(f"{r['tokens_per_s'][m]:.1f}"
                                        + (f" ({r['speedup'][m]:.2f}x)" if m in r["speedup"]
                                           else "") for m in methods)] for r in res["rows"]])
    for fam, rec in res["batch"].items():
        cross = rec["crossover"] if rec["crossover"] is not None else "beyond the sizes run"
        lines += ["", f"{fam}: K* per batch size {rec['k_star']}, crossover {cross}"]
        for b, t in (rec.get("tree") or {}).items():
            lines.append(f"- B = {b}: best tree {t['depth']} deep / {t['nodes']} nodes, "
                         f"{t['speedup']:.2f}x, " + ("beats" if t["wins"] else "does not beat")
                         + " the best chain and plain decoding")
    return lines + mixed_markdown(res["mixed"])


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["batch_size"] for r in res["rows"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, m in enumerate(res["rows"][0]["tokens_per_s"]):
        style = {"marker": "o", "label": m, "color": f"C{i}"}  # one colour per method
        a.plot(sizes, [r["tokens_per_s"][m] for r in res["rows"]], **style)
        if m in res["rows"][0]["speedup"]:
            b.plot(sizes, [r["speedup"][m] for r in res["rows"]], **style)
    b.axhline(1.0, color="grey", lw=0.8, ls="--")
    a.legend(fontsize=7)
    for ax, title in ((a, "tokens/s (all rows)"), (b, "speedup over plain batched decoding")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("batch size")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@hydra.main(config_path=str(decode.CONF_DIR), config_name="bench_batch", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)
    print((repo_path(cfg.out_dir) / "results.md").read_text())


if __name__ == "__main__":
    main()
