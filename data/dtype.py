"""Pick the compute dtype from a measurement on the machine at hand (``dtype=auto``).

CPUs of one machine kind differ: with AMX or AVX-512 BF16, bf16 matmuls ran 3-5x faster than fp32
here; without them bf16 ran about 4x slower. ``fastest_dtype`` times one GEMM of a draft-training
shape in each candidate dtype and returns the fastest; bf16 must beat fp32 by ``margin`` to be
chosen, since it costs precision. The rates are measured once per process and device.
"""
from __future__ import annotations

import time
from functools import cache

import torch

CANDIDATES = ("float32", "bfloat16")


PROBE = 256  # every dtype is first timed on at most this many rows and columns of the shape
MAX_CALL_S = 0.5  # a dtype whose whole product the probe projects past this keeps the probe's rate


def _seconds(m: int, k: int, n: int, dtype: torch.dtype, device: str, repeats: int) -> float:
    """Median seconds of an (m, k) x (k, n) product over ``repeats`` calls after one warm-up."""
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    times = []
    for i in range(repeats + 1):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


@cache
def matmul_rates(device: str = "cpu", m: int = 1024, k: int = 576, n: int = 8192,
                 repeats: int = 5) -> dict[str, float]:
    """GFLOP/s of an (m, k) x (k, n) matmul per candidate dtype on ``device`` (median of
    ``repeats`` after one warm-up). The default shape is one LM-head chunk of a training step.

    Each dtype is probed on a ``PROBE`` x ``PROBE`` corner of the output first; one whose whole
    product the probe projects past ``MAX_CALL_S`` keeps the probe's rate. Without bf16
    instructions bf16 falls back to a kernel that ran at 0.4 GFLOP/s on a 2-core Zen 3 (fp32
    about 125): the default shape took 24 s a call there, and timing it six times cost every
    ``dtype=auto`` process two and a half minutes. (The probe cuts rows and columns alike rather
    than keeping a few whole rows: MKL's fp32 GEMM on 8 rows ran at 5 GFLOP/s there.)"""
    rates = {}
    for name in CANDIDATES:
        dtype = getattr(torch, name)
        rows, cols = min(m, PROBE), min(n, PROBE)
        seconds = _seconds(rows, k, cols, dtype, device, 3)
        if (rows, cols) != (m, n) and seconds * (m / rows) * (n / cols) <= MAX_CALL_S:
            rows, cols, seconds = m, n, _seconds(m, k, n, dtype, device, repeats)
        rates[name] = 2 * rows * k * cols / seconds / 1e9
    return rates


def fastest_dtype(device: str = "cpu", margin: float = 1.2) -> str:
    """``"bfloat16"`` when its measured matmul rate is at least ``margin`` x fp32's, else
    ``"float32"``."""
    rates = matmul_rates(str(device))
    return "bfloat16" if rates["bfloat16"] >= margin * rates["float32"] else "float32"


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """``name`` unchanged, or the measured ``fastest_dtype`` for ``"auto"``."""
    if name == "auto":
        return fastest_dtype(device)
    if name not in (*CANDIDATES, "float16"):
        raise ValueError(f"dtype={name!r} is not one of auto, float32, bfloat16, float16")
    return name
