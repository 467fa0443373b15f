"""How much memory a training process can use on this machine.

The cgroup limit (``memory.max``, v1 ``memory.limit_in_bytes``) less what the cgroup already
holds, or ``MemAvailable`` when lower or without a limit, shared among the machine's local
processes, plus what this process already holds (its target is counted in the estimate of
``train/memory.py``); on CUDA, the device's free memory plus what this process reserved.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch


def size_text(n: float) -> str:
    """``n`` bytes as GiB (MiB below a tenth of one)."""
    gib = 1024 ** 3
    return f"{n / gib:.1f} GiB" if abs(n) >= gib / 10 else f"{n / 1024 ** 2:.0f} MiB"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_value(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        return None
    return None


def _meminfo_bytes(key: str, path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _own_resident_bytes() -> int:
    """Anonymous memory this process holds (its target, libraries); file pages not counted."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _cgroup_free(cgroup: Path = Path("/sys/fs/cgroup")) -> tuple[int, str] | None:
    """Bytes the cgroup limit still allows (v2, else v1), or None without a limit."""
    total = _meminfo_bytes("MemTotal") or 1 << 62
    limit = _read_int(cgroup / "memory.max")
    if limit is not None and limit < total:
        used = _stat_value(cgroup / "memory.stat", "anon")
        used = used if used is not None else _read_int(cgroup / "memory.current") or 0
        return limit - used, f"cgroup memory.max {size_text(limit)}"
    limit = _read_int(cgroup / "memory" / "memory.limit_in_bytes")
    if limit is not None and limit < total:
        used = _stat_value(cgroup / "memory" / "memory.stat", "rss")
        used = used if used is not None else _read_int(cgroup / "memory" / "memory.usage_in_bytes")
        return limit - (used or 0), f"cgroup memory.limit_in_bytes {size_text(limit)}"
    return None


def local_processes() -> int:
    """Training processes on this machine (they share its memory)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))))


def usable_memory(device: torch.device, processes: int | None = None) -> tuple[int, str]:
    """Bytes this process can use for training, and where the number comes from."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return (free + torch.cuda.memory_reserved(device),
                f"free memory of {device} + what this process reserved")
    n = processes or local_processes()
    own = _own_resident_bytes()
    free = _meminfo_bytes("MemAvailable") or 0
    source = "MemAvailable"
    cgroup = _cgroup_free()
    if cgroup is not None and cgroup[0] < free:
        free, source = max(cgroup[0], 0), cgroup[1]
    share = f" / {n} local processes" if n > 1 else ""
    return own + free // n, f"{source}{share} + {size_text(own)} this process holds"
