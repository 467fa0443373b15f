"""The rows of a sweep report: every job of a sweep directory read back, with its derived numbers.

Every ``*.json`` at the top of the directory that holds ``summary`` and ``samples`` is one
job (written by ``eval/sweep.py`` with a ``job`` block, or straight by ``eval/decode.py``);
``*.error.json`` files are failed jobs. Derived numbers:

- ``speedup``: as the job measured it (against plain decoding in the same run).
- ``speedup_vs_plain``: tokens/s over the tokens/s of the sweep's own plain job
  (``draft=none``) on the same prompts, limit, length, temperature, dtype and device.
- ``k_star``: within a group of jobs that differ only in K, the K with the highest
  ``speedup`` (``tokens_per_s`` when a job has no speedup); ties go to the smaller K.
- per-category tau: sum of output tokens over the sum of target forwards, where a
  sample's forwards are its tokens over its tau (the definition of the overall tau).
- trained vs served: the draft package's ``validation.json`` ``alpha_hat`` next to the
  served conditional ``alpha`` of jobs at the same temperature (at T = 0: validation's top-1
  agreement, the greedy acceptance probability); ``gap_flag``: some ``|alpha_hat_i - alpha_i|``
  exceeds ``gap_threshold`` and two binomial standard errors of the drafts reached there.
- predicted speedup (chain groups): the cost model of :mod:`eval.decoding.cost` on the alpha and
  costs of the draft package's ``speculation.json``, i.e. the expected speedups ``eval/measure.py``
  printed; only for groups at the temperature it was measured at.

``eval/report.py`` renders these rows as CSV, markdown and plots.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.eval.decoding.cost import expected_speedups, parse_costs

# Settings that must match for two jobs to be the same experiment apart from K.
GROUP_KEYS = ("method", "draft", "temperature", "prompts", "limit", "max_new_tokens", "dtype",
              "device", "tree_size", "schedule")
PLAIN_KEYS = ("prompts", "limit", "max_new_tokens", "temperature", "dtype", "device")


@dataclass
class DraftInfo:
    """What a draft package folder tells the report (all optional)."""

    validation: dict | None = None
    speculation: dict | None = None
    train_log: list[dict] = field(default_factory=list)


def _read_json(path: Path) -> dict | None:
    try:
        obj = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def load_jobs(sweep_dir: Path) -> tuple[list[dict], list[dict]]:
    """Read finished and failed jobs of a sweep directory.

    Returns:
        (jobs, errors): jobs are dicts with ``file``, ``job`` (settings block, may be empty),
        ``summary``, ``samples``; errors are the ``*.error.json`` contents plus ``file``.
    """
    jobs, errors = [], []
    for path in sorted(sweep_dir.glob("*.json")):
        if path.name.startswith("report"):
            continue
        obj = _read_json(path)
        if obj is None:
            continue
        if path.name.endswith(".error.json"):
            errors.append({**obj, "file": path.name})
        elif isinstance(obj.get("summary"), dict) and isinstance(obj.get("samples"), list):
            jobs.append({"file": path.name, "job": obj.get("job") or {}, "summary": obj["summary"],
                         "samples": obj["samples"]})
    return jobs, errors


def read_draft_info(draft: str | None) -> DraftInfo:
    """Read ``validation.json``, ``speculation.json`` and ``train_log.jsonl`` of a package."""
    info, d = DraftInfo(), Path(draft or ".")
    if not draft or not d.is_dir():
        return info
    info.validation = _read_json(d / "validation.json")
    info.speculation = _read_json(d / "speculation.json")
    log = d / "train_log.jsonl"
    if log.is_file():
        for line in log.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                info.train_log.append(rec)
    packaged = _read_json(d / "train_log.json")  # what training stores in the package
    if not info.train_log and isinstance(packaged, dict):
        info.train_log = [r for r in packaged.get("records", []) if isinstance(r, dict)]
    return info


def draft_name(draft: str | None) -> str:
    """Short display name: ``none``/``prompt_lookup`` as is, a path as ``parent/name``."""
    if not draft:
        return "-"
    p = Path(str(draft))
    if len(p.parts) <= 1:
        return str(draft)
    return f"{p.parent.name}/{p.name}"


def _setting(job: dict, key: str):
    """A job setting from the sweep's ``job.settings`` block, falling back to the summary."""
    settings = job["job"].get("settings") or {}
    if key in settings:
        return settings[key]
    return job["summary"].get(key)


def predicted_speedup(speculation: Mapping | None, ks: Sequence[int],
                      temperature: float | None = None) -> dict[int, float]:
    """Expected speedup per K of ``ks`` from a ``speculation.json``'s ``alpha`` and ``costs`` (what
    ``eval/measure.py`` printed); empty without them or when it measured another temperature."""
    spec = speculation or {}
    costs, alpha = parse_costs(spec.get("costs") or {}), spec.get("alpha")
    measured_t = (spec.get("measured") or {}).get("temperature")
    other_t = None not in (temperature, measured_t) and not math.isclose(
        float(temperature), float(measured_t), abs_tol=1e-6)
    if costs is None or not alpha or other_t:
        return {}
    return expected_speedups(alpha, costs, ks)


def category_tau(samples: Sequence[Mapping]) -> dict[str, dict]:
    """Per category: n samples, tokens, tau = sum(tokens) / sum(tokens / tau_sample)."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for s in samples:
        cat, tau = s.get("category"), s.get("tau")
        if cat is None or not tau:
            continue
        n_tok = len(s.get("output_ids") or [])
        a = acc[str(cat)]
        a[0] += 1
        a[1] += n_tok
        a[2] += n_tok / tau
    return {c: {"n": int(a[0]), "tokens": int(a[1]), "tau": a[1] / a[2] if a[2] else float("nan")}
            for c, a in sorted(acc.items())}


def _label(row: dict) -> str:
    method = row["method"] or "spec"
    if method == "spec":
        if row["draft"] in (None, "none"):
            head = "plain"
        elif row["draft"] in ("lookup", "prompt_lookup"):
            head = "lookup"
        else:
            head = f"{row['draft_kind'] or 'spec'}:{draft_name(row['draft'])}"
    else:
        head = method + ("" if row["draft"] in (None, "none") else ":" + draft_name(row["draft"]))
        if row.get("schedule"):
            head += f"({row['schedule']})"
    k = f" K={row['k']}" if row["k"] not in (None, 0) else ""
    return f"{head}{k} T={row['temperature']}"


def build_rows(jobs: list[dict], gap_threshold: float = 0.1) -> list[dict]:
    """One row per job with derived columns (see the module docstring)."""
    rows = []
    for j in jobs:
        s = j["summary"]
        row = {key: _setting(j, key) for key in
               ("method", "draft", "k", "tree_size", "schedule", "temperature", "prompts",
                "limit", "max_new_tokens", "dtype", "device")}
        row["method"] = row["method"] or "spec"
        row.update(job=j["job"].get("id") or Path(j["file"]).stem, file=j["file"],
                   draft_kind=s.get("draft_kind"), n_samples=len(j["samples"]),
                   lossless=s.get("lossless"), _summary=s, _samples=j["samples"])
        for key in ("tokens_generated", "target_forwards", "tau", "acceptance_rate",
                    "tokens_per_s", "speedup"):
            row[key] = s.get(key)
        row["alpha"] = list(s.get("alpha") or [])
        row["label"] = _label(row)
        rows.append(row)
    _mark_k_star(rows)
    _speedup_vs_plain(rows)
    _trained_vs_served(rows, gap_threshold)
    return rows


def _key(row: dict, keys: Sequence[str]) -> tuple:
    return tuple(json.dumps(row.get(k), sort_keys=True) for k in keys)


def k_groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Jobs with a K, grouped by every setting but K (``GROUP_KEYS``)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["k"] not in (None, 0):
            groups[_key(r, GROUP_KEYS)].append(r)
    return groups


def _score(r: dict) -> float:
    v = r["speedup"] if r["speedup"] is not None else r["tokens_per_s"]
    return float("-inf") if v is None else float(v)


def _mark_k_star(rows: list[dict]) -> None:
    for r in rows:
        r["k_star"] = False
    for group in k_groups(rows).values():
        best = max(group, key=lambda r: (_score(r), -int(r["k"])))
        if _score(best) > float("-inf"):
            best["k_star"] = True


def _speedup_vs_plain(rows: list[dict]) -> None:
    """Tokens/s over the sweep's plain decoder job and over its transformers generate job."""
    refs = {"speedup_vs_plain": lambda r: r["method"] == "spec" and r["draft"] in (None, "none"),
            "speedup_vs_hf_generate": lambda r: r["method"] == "hf_generate"}
    for col, is_ref in refs.items():
        ref = {_key(r, PLAIN_KEYS): r for r in rows if is_ref(r) and r["tokens_per_s"]}
        for r in rows:
            p = ref.get(_key(r, PLAIN_KEYS))
            r[col] = (r["tokens_per_s"] / p["tokens_per_s"]
                      if p is not None and r["tokens_per_s"] is not None else None)


def is_tree(row: dict) -> bool:
    """Whether a job drafted a tree (its per-depth acceptance is not a chain's alpha)."""
    return bool(row["_summary"].get("tree"))


def _trained_vs_served(rows: list[dict], gap_threshold: float) -> None:
    infos: dict[str, DraftInfo] = {}
    for r in rows:
        r.update(trained_alpha_hat=None, trained_temperature=None, gap_max=None,
                 gap_position=None, gap_flag=False, reached=None)
        d = r["draft"]
        if not d or d in ("none", "lookup", "prompt_lookup"):
            continue
        if is_tree(r):
            continue  # a tree's per-depth acceptance counts several candidates: not comparable
        info = infos.setdefault(d, read_draft_info(d))
        val = info.validation
        if not val or not val.get("alpha_hat"):
            continue
        # At T = 0 the served acceptance of a position is the chance that the draft's argmax is
        # the target's: validation's top-1 agreement. At T > 0 it is alpha-hat, when training
        # validated at that temperature.
        if r["temperature"] is not None and float(r["temperature"]) == 0.0 and val.get("top1"):
            r["trained_temperature"] = 0.0
            r["trained_alpha_hat"] = [float(a) for a in val["top1"]]
        else:
            r["trained_temperature"] = val.get("temperature")
            if r["temperature"] is None or val.get("temperature") is None or not math.isclose(
                    float(r["temperature"]), float(val["temperature"]), abs_tol=1e-6):
                continue
            r["trained_alpha_hat"] = [float(a) for a in val["alpha_hat"]]
        n = min(len(r["alpha"]), len(r["trained_alpha_hat"]))
        if n == 0:
            continue
        gaps = [abs(r["trained_alpha_hat"][i] - float(r["alpha"][i])) for i in range(n)]
        i_max = max(range(n), key=gaps.__getitem__)
        reached = list(r["_summary"].get("reached") or [])
        r.update(gap_max=gaps[i_max], gap_position=i_max + 1, reached=reached[:n],
                 gap_flag=any(gaps[i] > gap_threshold and _beyond_noise(
                     r["trained_alpha_hat"][i], gaps[i], reached[i] if i < len(reached) else None)
                     for i in range(n)))


def _beyond_noise(alpha_hat: float, gap: float, reached: int | None) -> bool:
    """Whether a served-vs-trained gap at one position is more than two standard errors of a
    binomial acceptance measured on ``reached`` drafts (None: the count is unknown, so yes);
    a position drafted a handful of times says little."""
    if reached is None:
        return True
    if reached == 0:
        return False
    se = math.sqrt(max(alpha_hat * (1.0 - alpha_hat), 1e-6) / reached)
    return gap > 2.0 * se


def build_category_rows(rows: list[dict]) -> list[dict]:
    """Long-format table: one row per (job, category)."""
    out = []
    for r in rows:
        for cat, v in category_tau(r["_samples"]).items():
            out.append({"job": r["job"], "label": r["label"], "category": cat, **v})
    return out
