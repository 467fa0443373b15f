"""What every engine runner shares (stdlib only: runners execute in the engines' environments).

    python <runner>.py JOB.json RESULT.json

A runner calls :func:`main` with its function for one job item; each item's result (or the
engine's own error, as a result) goes into RESULT.json with the engine's name and version.
"""
from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from importlib.metadata import version
from typing import Any


def main(engine: str, package: str, run_one: Callable[[dict, Any], dict], items: str = "runs",
         label: Callable[[Any], dict] = lambda run: {"name": run["name"]}) -> None:
    """Run ``run_one(job, item)`` for every ``job[items]``; write RESULT.json."""
    job_path, out_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    results = []
    for item in job[items]:
        try:
            results.append(run_one(job, item))
        except Exception as e:  # noqa: BLE001 (the engine's own error is the result)
            results.append({**label(item), "ok": False, "error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()[-4000:]})
    with open(out_path, "w") as f:
        json.dump({"engine": engine, "version": version(package), "runs": results}, f)
