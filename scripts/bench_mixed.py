"""The heterogeneous-rows test of ``scripts/bench_batch.py``: a batch of well-drafted rows and
one row whose drafts are always wrong (every draft token shifted by one id: a useless draft for
that row alone, at the same cost), against the same batch without it and each good row decoded
alone, per target cache layout. What one bad row costs the others, and what batching costs a
row on this machine.
"""
from __future__ import annotations

import statistics
from typing import Any

import torch
from omegaconf import DictConfig

from draftsmith.eval.decoding.batch import BatchDecoder
from draftsmith.eval.speedup import paired_speedup
from draftsmith.scripts.tooling import note

TOOL = "bench-batch"  # the tag of its progress lines (bench_batch's)


class Hostile:
    """Wraps a batched drafter: rows ``rows`` (of the batch as started) get every draft token
    shifted by one id, wherever they are in the batch as rows leave it."""

    def __init__(self, drafter: Any, rows: list[int], vocab: int) -> None:
        self.inner, self.rows, self.vocab = drafter, set(rows), vocab
        self.live: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def start(self, tokens: list[list[int]], *args: Any) -> None:
        self.live = list(range(len(tokens)))
        self.inner.start(tokens, *args)

    def select(self, idx: torch.Tensor) -> None:
        self.live = [self.live[i] for i in idx.tolist()]
        self.inner.select(idx)

    def propose_chains(self, ks: torch.Tensor, sampling: Any, generator: Any,
                       budgets: Any = None) -> tuple[torch.Tensor, Any, torch.Tensor]:
        drafts, q, ks = self.inner.propose_chains(ks, sampling, generator, budgets)
        at = [i for i, r in enumerate(self.live) if r in self.rows]
        drafts = drafts.clone()
        drafts[at] = (drafts[at] + 1) % self.vocab
        return drafts, q, ks


def bench_mixed(cfg: DictConfig, model: Any, proposers: dict, records: list[dict],
                eos: Any, mixed_ks: dict[str, tuple[int, int]]) -> list[dict]:
    """Good rows batched with one hostile row, against the same batch whose last row is not
    hostile (what the hostile row costs the others), and against each good row alone (what
    batching costs a row on this machine); per target cache layout, all in the same rounds.
    ``mixed_ks[family]``: the K alone and batched (``scripts.bench_batch.mixed_k``)."""
    good = [r["prompt_ids"] for r in records[: int(cfg.mixed.good_rows)]]
    last = records[int(cfg.mixed.good_rows)]["prompt_ids"]
    new, temp = int(cfg.max_new_tokens), float(cfg.temperature)
    layouts = list(cfg.mixed.get("layouts", ["padded"]))
    out = []
    for fam, proposer in proposers.items():
        k_alone, k = mixed_ks[fam]
        decs = {"alone": BatchDecoder(model, proposer, k=k_alone, fallback=True)}
        for lay in layouts:
            decs[f"clean {lay}"] = BatchDecoder(model, proposer, k=k, fallback=True, layout=lay)
            decs[f"mixed {lay}"] = BatchDecoder(model, proposer, k=k, fallback=True, layout=lay)
            decs[f"mixed {lay}"].drafter = Hostile(decs[f"mixed {lay}"].drafter, [len(good)],
                                                   int(model.config.vocab_size))
        runs: dict[str, list[list[float]]] = {name: [] for name in decs}
        hostile_spec: dict[str, list[float]] = {lay: [] for lay in layouts}
        for rnd in range(int(cfg.repeats)):
            note(TOOL, f"heterogeneous rows, {fam}, round {rnd + 1}")
            runs["alone"].append([decs["alone"].generate([p], new, temp, eos_token_id=eos,
                                                         seed=rnd)[0].stats.tokens_per_s
                                  for p in good])
            for name, dec in decs.items():
                if name == "alone":
                    continue
                res = dec.generate([*good, last], new, temp, eos_token_id=eos, seed=rnd)
                runs[name].append([r.stats.tokens_per_s for r in res[:len(good)]])
                if name.startswith("mixed"):
                    st = res[-1].stats
                    hostile_spec[name.split()[1]].append(
                        st.spec_steps / max(st.spec_steps + st.plain_steps, 1))
        per_row = {n: [[r[i] for r in v] for i in range(len(good))] for n, v in runs.items()}
        for lay in layouts:
            vs_clean = paired_speedup(per_row[f"mixed {lay}"], per_row[f"clean {lay}"]).ratios
            vs_alone = paired_speedup(per_row[f"mixed {lay}"], per_row["alone"]).ratios
            out.append({"draft": fam, "k": k, "k_alone": k_alone, "layout": lay,
                        "good_rows": len(good),
                        "good_rows_vs_clean_batch": vs_clean, "worst_vs_clean": min(vs_clean),
                        "good_rows_vs_alone": vs_alone, "worst": min(vs_alone),
                        "hostile_speculative_step_share": statistics.median(hostile_spec[lay])})
    return out


def mixed_markdown(rows: list[dict]) -> list[str]:
    """The heterogeneous rows' paragraphs of ``results.md``."""
    lines = []
    for m in rows:
        clean = ", ".join(f"{x:.2f}" for x in m["good_rows_vs_clean_batch"])
        alone = ", ".join(f"{x:.2f}" for x in m["good_rows_vs_alone"])
        lines += ["", (f"Heterogeneous rows ({m['draft']}, K = {m['k']}, alone at K = "
                       f"{m.get('k_alone', m['k'])}, "
                       f"{m.get('layout', 'padded')} cache): {m['good_rows']} good "
                       "rows batched with one row whose drafts are always wrong; each good "
                       "row's tokens/s over the same row in the same batch without the hostile "
                       f"row: {clean} (worst {m['worst_vs_clean']:.2f}); over the row decoded "
                       f"alone: {alone} (worst {m['worst']:.2f}); the hostile row speculated on "
                       f"{m['hostile_speculative_step_share']:.0%} of its steps")]
    return lines
