"""What machine a measurement ran on: hardware, software versions and date, for every record."""
from __future__ import annotations

import datetime
import os
import platform
from typing import Any

import torch


def _cpuinfo(key: str) -> str | None:
    """The value of the first ``key`` line of ``/proc/cpuinfo`` (None: no such line, or none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


# instruction-set features that change which dtype and which draft shape is fastest
ISA_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2", "fma")


def cpu_isa() -> list[str]:
    """The :data:`ISA_FLAGS` this CPU reports in ``/proc/cpuinfo`` (empty where unreadable)."""
    flags = set((_cpuinfo("flags") or "").split())
    return [name for name in ISA_FLAGS if name in flags]


def environment(device: torch.device | str | None = None) -> dict[str, Any]:
    """``{"hardware", "versions", "date"}`` of this process, ``device`` the one measured on."""
    import transformers

    hw: dict[str, Any] = {"cpu": _cpu_model(), "machine": platform.machine(),
                          "platform": platform.platform(), "cpu_count": os.cpu_count(),
                          "torch_threads": torch.get_num_threads(), "isa": cpu_isa()}
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        hw["gpu"] = torch.cuda.get_device_name(dev)
    hw["device"] = str(dev) if dev is not None else "cpu"
    return {"hardware": hw,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
