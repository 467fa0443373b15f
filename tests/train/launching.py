"""Launching the recipe for tests: in process, through ``accelerate launch`` on one machine, or
as several accelerate "machines" on this one (localhost rendezvous), and reading what it wrote."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
# One torch thread per process: the tests run beside another pytest worker on two cores, where
# the recipe's default (the machine's cores per local process) would oversubscribe them.
TINY = ["debug=tiny", "data=sharegpt_tiny", "data.num_conversations=24", "data.max_length=96",
        "logging=none", "train.cpu_threads=1"]
# The data-parallel parity runs: the EAGLE head without feature noise, so the update is a
# deterministic function of the data; the same global batch (4 sequences) everywhere. The
# one-process reference (micro-batch 4) is launched once per session (conftest.py).
PARITY = TINY + ["draft=eagle", "draft.config.feature_noise=0", "train.max_steps=3",
                 "train.eval_every=3", "train.save_every=3", "seed=1"]


def compose_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="distill", overrides=overrides)


def run_inprocess(overrides: list[str]) -> dict:
    """``run`` in this process, with this process's torch thread count (the recipe's default,
    the machine's cores, would oversubscribe the cores another pytest worker is using)."""
    from accelerate.state import AcceleratorState

    from draftsmith.train.distill import run

    if not any(o.startswith("train.cpu_threads=") for o in overrides):
        overrides = [*overrides, f"train.cpu_threads={torch.get_num_threads()}"]
    AcceleratorState._reset_state(True)
    try:
        return run(compose_config(overrides))
    finally:
        AcceleratorState._reset_state(True)


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def launch(args: list[str], out_dir: Path, overrides: list[str], port: int,
           check: bool = True) -> subprocess.CompletedProcess:
    env = ENV
    cmd = [ACCELERATE, "launch", *args, "--main_process_port", str(port), "train/distill.py",
           *overrides, f"out_dir={out_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return proc


def weights(out_dir: Path) -> dict[str, torch.Tensor]:
    pkg = out_dir / "draft"
    files = sorted(pkg.glob("*.safetensors"))
    assert files, f"no weights in {pkg}"
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def assert_same(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    worst = max((x - b[k]).abs().max().item() for k, x in a.items())
    assert worst <= atol, f"weights differ by {worst:.3g} > {atol}"


def log_rows(out_dir: Path) -> list[dict]:
    path = out_dir / "train_log.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def assert_resumed(console: str, rows: list[dict], ckpt: Path, last_step: int) -> None:
    """A relaunch resumed from ``ckpt``: it said so, and its ``train_log.jsonl`` rows (``rows``)
    count on from the checkpoint's step to ``last_step`` without a fresh start."""
    step = int(ckpt.name.removeprefix("step-"))  # the folder's own step: later saves rotate it
    assert re.search(rf"resumed from \S*{ckpt.name} \(step {step},", console), (
        f"the relaunch did not log 'resumed from .../{ckpt.name} (step {step}, ...)'")
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == list(range(step + 1, last_step + 1)), (
        f"the relaunch trained steps {steps}, not {step + 1}..{last_step} after the checkpoint "
        f"of step {step}")
    assert not any(r.get("tag") == "init" for r in rows), "the relaunch validated from scratch"


def launch_machines(config_file: str, out_dir: Path, overrides: list[str], port: int,
                    machines: int = 2, extra: tuple[str, ...] = (),
                    per_machine=lambda rank: []) -> list[subprocess.Popen]:
    """Start ``machines`` accelerate "machines" on this one (one process each, rendezvous at
    127.0.0.1:``port``), as ``accelerate launch --num_machines N --machine_rank R`` on N hosts
    would; each one's console goes to ``<out_dir>.machine<R>.log``. ``per_machine(R)`` adds
    overrides for machine R only (e.g. its own cache folder, as on its own disk)."""
    procs = []
    for rank in range(machines):
        cmd = [ACCELERATE, "launch", "--config_file", config_file, "--num_machines",
               str(machines), "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
               "--main_process_port", str(port), "--num_processes", str(machines), *extra,
               "train/distill.py", *overrides, *per_machine(rank), "train.cpu_threads=1",
               f"out_dir={out_dir}"]
        with open(f"{out_dir}.machine{rank}.log", "w") as console:
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=console,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def wait_machines(procs: list[subprocess.Popen], out_dir: Path, timeout: float = 600) -> None:
    """Wait for every machine; a failure raises with the machines' consoles."""
    codes = [p.wait(timeout=timeout) for p in procs]
    if any(codes):
        logs = "\n".join(Path(f"{out_dir}.machine{r}.log").read_text()[-4000:]
                         for r in range(len(procs)))
        raise AssertionError(f"machines exited with {codes}:\n{logs}")


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (torchrun starts its workers in their own sessions, so
    killing a launcher's process group would leave its workers running)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def kill_machine(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Stop a whole "machine": its launcher and every worker under it."""
    for pid in process_tree(proc.pid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
