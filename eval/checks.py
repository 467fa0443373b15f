"""Checks of evaluation settings and output paths, run before any model is loaded.

``eval/decode.py``, ``eval/measure.py``, ``eval/sweep.py`` and ``scripts/bench.py`` call these in
their validation functions: a bad sampling value (NaN named as such) or an output path that is a
directory, cannot be created or lands on an input (the prompts, a draft package or export) fails
in a second, with the key, the value and the fix, instead of after the target loaded and warmed
up, and without overwriting anything. No torch import here: the checks stay cheap.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

PACKAGE_JSON = "draftsmith.json"  # heads.package.PACKAGE_JSON (not imported: it pulls in torch)
MANIFEST = "manifest.json"
# config values that name no file: drafts without a package, built-in prompt sets
NOT_PATHS = ("", "none", "null", "lookup", "prompt_lookup", "humaneval", "sharegpt")


def number(key: str, value: Any, allowed: str) -> float:
    """``value`` as a finite float; else ValueError naming ``key``, the value and ``allowed``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}={value!r} is not a number; pass {allowed}") from None
    if math.isnan(x):
        raise ValueError(f"{key}=nan is NaN (not a number); pass {allowed}")
    if math.isinf(x):
        raise ValueError(f"{key}={x} is infinite; pass {allowed}")
    return x


def integer(key: str, value: Any, allowed: str) -> int:
    """``value`` as an int (``4.0`` is fine, ``4.5`` is not); ValueError as :func:`number`."""
    x = number(key, value, allowed)
    if not x.is_integer():
        raise ValueError(f"{key}={value!r} is not an integer; pass {allowed}")
    return int(x)


def check_sampling(temperature: Any = 0.0, top_k: Any = 0, top_p: Any = 1.0) -> None:
    """Refuse a temperature that is not finite and >= 0, a top_p outside (0, 1] and a negative
    or fractional top_k (the decoder's :func:`eval.decoding.verify.warp` would refuse them only
    after the model loaded and warmed up, or fail inside torch for NaN)."""
    allowed = "a finite temperature >= 0 (0 = greedy, > 0 samples)"
    if number("temperature", temperature, allowed) < 0:
        raise ValueError(f"temperature={temperature} is negative; pass {allowed}")
    allowed = "top_p in (0, 1] (1.0 = off)"
    if not 0.0 < number("top_p", top_p, allowed) <= 1.0:
        raise ValueError(f"top_p={top_p} is outside (0, 1]; pass {allowed}")
    allowed = "an integer top_k >= 0 (0 = off)"
    if integer("top_k", top_k, allowed) < 0:
        raise ValueError(f"top_k={top_k} is negative; pass {allowed}")


def package_holding(folder: Path) -> Path | None:
    """The draft package or export that ``folder`` is or lies inside (the nearest folder up with
    ``draftsmith.json``, or a ``manifest.json`` listing files), else None."""
    for f in (folder, *folder.parents):
        if (f / PACKAGE_JSON).is_file():
            return f
        if (f / MANIFEST).is_file():
            try:
                manifest = json.loads((f / MANIFEST).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(manifest, dict) and "files" in manifest and (
                    "export_format" in manifest or "draft_kind" in manifest):
                return f
    return None


def _creatable(key: str, value: Any, folder: Path) -> None:
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{key}={value}: {existing} is a file, so the folder {folder} cannot be "
                         f"created; choose another {key}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{key}={value}: {existing} is not writable, so {folder} cannot be "
                         f"written; choose another {key}")


def _input_paths(inputs: Mapping[str, Any]) -> Iterable[tuple[str, Any, Path]]:
    for name, given in inputs.items():
        if given is None or str(given).lower() in NOT_PATHS:
            continue
        path = Path(str(given)).expanduser()
        if path.exists():
            yield name, given, path.resolve()


def _not_an_input(key: str, value: Any, folder: Path, written: Iterable[Path],
                  inputs: Mapping[str, Any]) -> None:
    folder = folder.resolve()
    written = [p.resolve() for p in written]
    for name, given, path in _input_paths(inputs):
        if path in written:
            raise ValueError(f"{key}={value} would overwrite {name}={given}, an input of this "
                             f"run; choose another {key}")
        if path.is_dir() and (path == folder or path in folder.parents):
            raise ValueError(f"{key}={value} writes into {name}={given}, an input of this run; "
                             f"choose a {key} outside it")
    pkg = package_holding(folder)
    if pkg is not None:
        raise ValueError(f"{key}={value} writes into the draft package or export {pkg}, whose "
                         f"manifest lists its files; choose a {key} outside it")


def check_out_file(key: str, value: Any, inputs: Mapping[str, Any]) -> None:
    """Refuse an output file (``out=``) that is an existing directory, whose folder cannot be
    created, or that would overwrite or write into an input (``inputs``: config key -> value;
    names such as ``none`` or ``humaneval`` and missing paths are skipped). None: no output."""
    if value is None or str(value) == "":
        return
    out = Path(str(value)).expanduser()
    if out.is_dir():
        raise ValueError(f"{key}={value} is an existing directory; {key} is the JSON file to "
                         f"write: pass a file path, e.g. {key}={out / 'run.json'}")
    _creatable(key, value, out.parent)
    _not_an_input(key, value, out.parent, [out], inputs)


def check_out_dir(key: str, value: Any, inputs: Mapping[str, Any],
                  writes: Iterable[str] = ()) -> None:
    """Refuse an output folder (``out_dir=``, ``sweep_dir=``) that is a file, cannot be created,
    is or lies inside a draft package, an export or a folder input, or whose files ``writes``
    would overwrite an input file."""
    out = Path(str(value)).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{key}={value} is a file; {key} is the folder results are written "
                         "into: pass a folder path")
    _creatable(key, value, out)
    _not_an_input(key, value, out, [out / w for w in writes], inputs)


def check_noise_tolerance(value: Any) -> None:
    """``noise_tolerance``: a finite fraction >= 0 of the plain tokens/s (before loading)."""
    allowed = "a fraction >= 0 such as 0.1"
    if value is not None and number("noise_tolerance", value, allowed) < 0:
        raise ValueError(f"noise_tolerance={value} is negative; pass {allowed}")
