"""dtype=auto: the faster of fp32 and bf16, from a measurement on this machine."""
from __future__ import annotations

import pytest
import torch

from draftsmith.data import dtype as dt


def test_auto_picks_bf16_only_when_it_is_clearly_faster(monkeypatch):
    for rates, want in (({"float32": 200.0, "bfloat16": 700.0}, "bfloat16"),
                        ({"float32": 250.0, "bfloat16": 60.0}, "float32"),
                        ({"float32": 200.0, "bfloat16": 220.0}, "float32")):  # under the margin
        monkeypatch.setattr(dt, "matmul_rates", lambda device, r=rates: r)
        assert dt.fastest_dtype("cpu") == want
        assert dt.resolve_dtype("auto") == want
    assert dt.resolve_dtype("float16") == "float16"
    with pytest.raises(ValueError, match="auto, float32, bfloat16, float16"):
        dt.resolve_dtype("fp8")


def test_matmul_rates_are_measured_per_dtype():
    rates = dt.matmul_rates("cpu", 64, 32, 64, repeats=2)
    assert set(rates) == {"float32", "bfloat16"} and all(r > 0 for r in rates.values())


def test_a_dtype_far_slower_than_the_budget_is_rated_on_the_probe_alone(monkeypatch):
    # bf16 without bf16 instructions: 0.4 GFLOP/s, a whole default-shape product 24 s a call;
    # its rate must come from the probe, while fp32 is timed on the whole shape
    calls = []

    def fake_seconds(m, k, n, dtype, device, repeats):
        calls.append((str(dtype).removeprefix("torch."), m, n))
        gflops = 0.4 if dtype == torch.bfloat16 else 125.0
        return 2 * m * k * n / gflops / 1e9

    monkeypatch.setattr(dt, "_seconds", fake_seconds)
    rates = dt.matmul_rates.__wrapped__("cpu", 1024, 576, 8192)
    probe = ("float32", dt.PROBE, dt.PROBE)
    assert calls == [probe, ("float32", 1024, 8192), ("bfloat16", dt.PROBE, dt.PROBE)]
    assert rates == pytest.approx({"float32": 125.0, "bfloat16": 0.4})
