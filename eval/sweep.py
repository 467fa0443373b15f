"""Evaluation sweeps: every checkpoint, K, temperature and peer through one decoder.

Usage::

    python eval/sweep.py -m draft=runs/a/final,runs/b/final k=1,2,4,8 temperature=0,1 \\
        prompts=/path/question.jsonl limit=10 name=ab
    python eval/sweep.py -m method=spec,hf_generate,hf_assisted,hf_prompt_lookup \\
        draft=none,runs/lm/final k=4 schedule=constant,heuristic name=peers

Design (why Hydra multirun and not a home-made grid): Hydra's basic launcher calls
:func:`main` once per grid point in this process. Each call turns its config into
*normalized settings* (:func:`eval.sweep_jobs.normalize_settings`: keys a method ignores are
dropped, so ``method=hf_generate`` with ``k=1,2,4`` is one job, not three; combinations that
make no sense, e.g. assisted generation without a draft LM, are skipped) and runs
:func:`run_job`, which

- names the job file ``<slug>-<hash>.json`` after a stable hash of the settings (plus the
  sha256 of the draft package's ``manifest.json``, so a retrained checkpoint reruns);
- skips the job when that file already holds valid JSON (a killed sweep resumes);
- writes results atomically (``.tmp`` then rename), so a kill never leaves a half file;
- catches any exception into ``<slug>-<hash>.error.json`` (type, message, traceback) and
  returns, so the sweep goes on (Hydra never sees the failure);
- runs the job in a child process (``python eval/sweep.py --run-job``) when it sets a
  process-level setting (``threads`` or ``dtype``; ``isolate=auto``), or always
  (``isolate=true``).

The report runs once, at the end, from the Hydra callback :class:`SweepCallback`
(``on_multirun_end``; ``on_run_end`` for a single run), which also draws the tqdm bar over
jobs. If a sweep is killed, rerun the same command (finished jobs are skipped) or call
``python eval/report.py SWEEP_DIR``. Do not sweep ``sweep_dir``/``name`` themselves.
In Python, :func:`run_sweep` takes a list of settings and an injectable runner.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import re
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from enum import Enum
from pathlib import Path
from typing import Any

import hydra
from tqdm.auto import tqdm

from draftsmith.eval import CONF_DIR
from draftsmith.eval.sweep_jobs import DECODE_KEYS, is_done, job_id, job_stem, normalize_settings
from draftsmith.heads.manifest import write_json_atomic

log = logging.getLogger("draftsmith.sweep")
REPO = Path(__file__).resolve().parents[1]
DEFAULT_RUNNER = "draftsmith.eval.sweep:default_runner"  # the runner spec (module:function)

Runner = Callable[[dict], dict]
PROCESS_KEYS = ("threads", "dtype")  # settings that change process-wide state


class JobFailedError(RuntimeError):
    """A job run in a child process exited with an error (its traceback is in the message)."""


class Isolate(Enum):
    """When a job runs in a child process (the config's ``isolate``: auto, true or false)."""

    AUTO = "auto"  # when the job sets a process-level setting (PROCESS_KEYS)
    ALWAYS = "true"
    NEVER = "false"

    @classmethod
    def parse(cls, value: Any) -> Isolate:
        """The member for a config value; Hydra and YAML read ``true``/``false`` as booleans.

        Raises:
            ValueError: ``value`` is not auto, true or false (the message names them).
        """
        text = str(value).lower() if isinstance(value, bool) else value
        try:
            return cls(text)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ValueError(f"isolate={value!r}: allowed values are {allowed}") from None


def validate(cfg: Mapping[str, Any]) -> None:
    """Refuse, before any job runs or any model loads, a ``sweep_dir`` that is a file or lies in
    a draft package, an export or a folder input (job files and the report would be written
    into it), a prompt set the decoder cannot read and sampling values it would refuse.

    Raises:
        ValueError: naming the key, the value and the fix.
    """
    from draftsmith.data.prompts import check_prompt_set
    from draftsmith.eval.checks import check_out_dir, check_sampling

    check_out_dir("sweep_dir", cfg.get("sweep_dir"),
                  {k: cfg.get(k) for k in ("draft", "prompts", "target")})
    check_sampling(**{k: cfg[k] for k in ("temperature", "top_k", "top_p")
                      if cfg.get(k) is not None})
    if cfg.get("prompts") is not None:
        check_prompt_set(cfg["prompts"])


def _decoder_overrides(settings: Mapping[str, Any]) -> list[str]:
    """Hydra override strings for the decoder (non-null decode keys only)."""
    out = []
    for key in DECODE_KEYS:
        v = settings.get(key)
        if v is None:
            continue
        if isinstance(v, str) and not re.fullmatch(r"[A-Za-z0-9_./:+-]+", v):
            v = "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
        out.append(f"{key}={v}")
    return out


def default_runner(settings: dict) -> dict:
    """Run one job: the speculative decoder (``method=spec``) or a transformers peer.

    Returns:
        ``{"summary": {...}, "samples": [...]}`` as ``eval/decode.py`` writes it.
    """
    if settings["method"] != "spec":
        from draftsmith.eval import peers

        return peers.run_peer(settings)
    return run_decoder(_decoder_overrides(settings))


@contextlib.contextmanager
def outside_hydra() -> Iterator[None]:
    """Set this Hydra app's global state aside while the decoder composes its own config.

    Hydra refuses a second ``initialize`` while the sweep's app is initialized; the state is
    restored afterwards so the launcher carries on with the next job.
    """
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    if not GlobalHydra.instance().is_initialized():
        yield
        return
    backup = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        yield
    finally:
        restore_gh_from_backup(backup)


def run_decoder(overrides: list[str]) -> dict:
    """Run ``eval/decode.py`` with Hydra overrides and return its JSON.

    In-process when the module offers ``run_overrides(list[str]) -> dict``; otherwise its
    CLI in a child process (``python eval/decode.py ... out=FILE``), the stable contract.
    """
    try:
        decode = importlib.import_module("draftsmith.eval.decode")
    except ImportError as exc:
        raise RuntimeError("eval/decode.py is missing or does not import: method=spec needs "
                           f"the decoder CLI ({exc})") from exc
    if callable(getattr(decode, "run_overrides", None)):
        with outside_hydra():
            return decode.run_overrides(list(overrides))
    out = (Path(os.environ.get("TMPDIR", "/tmp"))
           / f"draftsmith-decode-{os.getpid()}-{time.time_ns()}.json")
    cmd = [sys.executable, str(REPO / "eval" / "decode.py"), *overrides, f"out={out}"]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            raise JobFailedError(f"eval/decode.py exited with {proc.returncode}:\n"
                                 f"{proc.stderr[-4000:]}")
        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)


def _load_runner(spec: str) -> Runner:
    mod, _, fn = spec.partition(":")
    return getattr(importlib.import_module(mod), fn or "default_runner")


def _run_in_child(settings: dict, sweep_dir: Path, runner_spec: str,
                  timeout_s: float | None) -> dict:
    stem = job_stem(settings)
    job_file = sweep_dir / f".{stem}.settings.json"
    out_file = sweep_dir / f".{stem}.child.json"
    job_file.write_text(json.dumps(settings))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-job", str(job_file),
           "--out", str(out_file), "--runner", runner_spec]
    try:  # the child imports the installed draftsmith.*, and the runner's module from PYTHONPATH
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True,
                              timeout=timeout_s)
        if proc.returncode != 0:
            raise JobFailedError(f"child process exited with {proc.returncode}:\n"
                                 f"{proc.stderr[-4000:]}")
        return json.loads(out_file.read_text())
    finally:
        job_file.unlink(missing_ok=True)
        out_file.unlink(missing_ok=True)


def needs_isolation(settings: Mapping[str, Any], isolate: Isolate = Isolate.AUTO) -> bool:
    """Whether a job runs in a child process (see :class:`Isolate`)."""
    if isolate is Isolate.AUTO:
        return any(settings.get(k) is not None for k in PROCESS_KEYS)
    return isolate is Isolate.ALWAYS


def run_job(settings: dict, sweep_dir: str | Path, runner: Runner = default_runner,
            isolate: Isolate = Isolate.AUTO, runner_spec: str = DEFAULT_RUNNER,
            timeout_s: float | None = None) -> str:
    """Run one job unless it is done; record its result or its error.

    Args:
        settings: normalized settings (:func:`eval.sweep_jobs.normalize_settings`).
        sweep_dir: folder of job files (created if missing).
        runner: in-process runner ``settings -> {"summary", "samples"}``.
        isolate: run in a child process (see :func:`needs_isolation`); the child calls
            ``runner_spec`` (``module:function``) instead of ``runner``.
        timeout_s: wall limit of a child process.

    Returns:
        ``"done"`` (ran and wrote its JSON), ``"skipped"`` (already done) or ``"failed"``
        (``<stem>.error.json`` written).
    """
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    stem = job_stem(settings)
    result_path, error_path = sweep_dir / f"{stem}.json", sweep_dir / f"{stem}.error.json"
    if is_done(result_path):
        return "skipped"
    child = needs_isolation(settings, isolate)
    meta = {"id": job_id(settings), "settings": settings,
            "runner": "child" if child else "inprocess",
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.version.split()[0]}
    t0 = time.perf_counter()
    try:
        result = (_run_in_child(settings, sweep_dir, runner_spec, timeout_s) if child
                  else runner(settings))
        if not (isinstance(result, Mapping) and isinstance(result.get("summary"), Mapping)
                and isinstance(result.get("samples"), list)):
            raise TypeError("the runner must return {'summary': dict, 'samples': list}, got "
                            f"{type(result).__name__} with keys "
                            f"{list(result)[:5] if isinstance(result, Mapping) else '-'}")
        meta["elapsed_s"] = time.perf_counter() - t0
        write_json_atomic(result_path, {"job": meta, "summary": dict(result["summary"]),
                                         "samples": list(result["samples"])})
        error_path.unlink(missing_ok=True)
        return "done"
    except Exception as exc:  # noqa: BLE001 - a failing job is recorded; the sweep goes on
        meta["elapsed_s"] = time.perf_counter() - t0
        write_json_atomic(error_path, {"job": meta, "error": {
            "type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}})
        log.error("job %s failed: %s: %s", stem, type(exc).__name__,
                  (str(exc).splitlines() or [""])[0])
        return "failed"


def run_sweep(jobs: Iterable[Mapping[str, Any]], sweep_dir: str | Path,
              runner: Runner = default_runner, isolate: Isolate = Isolate.AUTO,
              progress: bool = True, report: bool = True, gap_threshold: float = 0.1,
              runner_spec: str = DEFAULT_RUNNER) -> Counter:
    """Run a list of raw job settings in order (the Python twin of a Hydra multirun).

    Jobs are normalized and deduplicated first; the report is written once at the end.

    Returns:
        Counter of statuses: done, skipped, failed, not_applicable.
    """
    counts: Counter = Counter()
    planned, seen = [], set()
    for raw in jobs:
        validate({**raw, "sweep_dir": sweep_dir})  # every job, before the first one runs
        s = normalize_settings(raw)
        if s is None:
            counts["not_applicable"] += 1
        elif job_id(s) not in seen:
            seen.add(job_id(s))
            planned.append(s)
    for s in tqdm(planned, desc="sweep", unit="job", disable=not progress):
        counts[run_job(s, sweep_dir, runner, isolate, runner_spec)] += 1
    if report:
        from draftsmith.eval.report import build_report

        build_report(sweep_dir, gap_threshold)
    return counts


# ----------------------------------------------------------------------------- Hydra glue
try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra is a hard dependency
    _HydraCallback = object


def _count_jobs(config: Any) -> int | None:
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
        return sum(len(b) for b in BasicSweeper.split_arguments(parsed, None))
    except Exception:  # noqa: BLE001 - the count only sizes the progress bar
        return None


class SweepCallback(_HydraCallback):
    """Hydra callback: a tqdm bar over jobs and one report at the end of the (multi)run."""

    def __init__(self) -> None:
        self.bar = None
        self.counts: Counter = Counter()

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self.bar = tqdm(total=_count_jobs(config), desc="sweep", unit="job")

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        status = getattr(job_return, "_return_value", None) or "failed"
        self.counts[status] += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(dict(self.counts))

    def _report(self, config: Any) -> None:
        if self.bar is not None:
            self.bar.close()
        log.info("sweep finished: %s", dict(self.counts))
        if config.get("report", True):
            from draftsmith.eval.report import build_report

            rep = build_report(config.sweep_dir, float(config.get("gap_threshold", 0.1)))
            print(f"report: {rep.files['markdown']} ({len(rep.rows)} jobs, "
                  f"{len(rep.errors)} failed)")

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        self._report(config)

    def on_run_end(self, config: Any, **kwargs: Any) -> None:
        self._report(config)


@hydra.main(config_path=str(CONF_DIR), config_name="sweep", version_base="1.3")
def task(cfg: Any) -> str:
    """One Hydra job: normalize its settings and run it (status string returned)."""
    isolate = Isolate.parse(cfg.isolate)
    validate(cfg)
    settings = normalize_settings(cfg)
    if settings is None:
        log.info("not applicable, skipped: %s", {k: cfg.get(k) for k in ("method", "draft")})
        return "not_applicable"
    spec = cfg.get("runner") or DEFAULT_RUNNER
    return run_job(settings, cfg.sweep_dir, _load_runner(spec), isolate,
                   runner_spec=spec, timeout_s=cfg.get("job_timeout_s"))


def _child_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-job", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--runner", default=DEFAULT_RUNNER)
    args = ap.parse_args(argv)
    settings = json.loads(Path(args.run_job).read_text())
    if settings.get("threads"):
        import torch

        torch.set_num_threads(int(settings["threads"]))
    result = _load_runner(args.runner)(settings)
    Path(args.out).write_text(json.dumps(result, default=str))
    return 0


def main() -> None:
    """Entry point: the child mode (``--run-job``) or the Hydra app."""
    if len(sys.argv) > 1 and sys.argv[1] == "--run-job":
        raise SystemExit(_child_main(sys.argv[1:]))
    task()


if __name__ == "__main__":
    main()
