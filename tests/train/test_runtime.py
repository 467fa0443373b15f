"""Process plumbing of the recipe (data/malloc.py, train/runtime.py): allocator re-exec,
threads, the launch check, the epoch loader, the schedule and the step log, each without running
a training job."""
from __future__ import annotations

import itertools
import json
import math
import sys
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from draftsmith.data import malloc
from draftsmith.data.malloc import (
    MALLOC_SWITCH,
    SHAPE_CACHES,
    TUNED_MALLOC,
    reexec_with_tuned_malloc,
    restart_as_command,
)
from draftsmith.train import runtime
from draftsmith.train.config import ConfigError
from draftsmith.train.runtime import (
    StepLog,
    cosine_with_warmup,
    cpu_threads,
    make_accelerator,
    make_epoch_loader,
)


# ----- reexec_with_tuned_malloc ------------------------------------------------------------------
@pytest.fixture
def execve(monkeypatch):
    """Record ``os.execve`` calls instead of re-exec'ing."""
    events: list = []
    monkeypatch.setattr(malloc.os, "execve",
                        lambda path, argv, env: events.append(("execve", path, argv, env)))
    monkeypatch.setattr(malloc.sys, "platform", "linux")
    monkeypatch.setattr(sys, "orig_argv", ["python3", "-X", "utf8", "train/distill.py", "seed=3"])
    for key in (*TUNED_MALLOC, MALLOC_SWITCH):
        monkeypatch.delenv(key, raising=False)
    for key in SHAPE_CACHES:  # a restart sets them in this process: gone again after the test
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    return events


def _execs(events: list) -> list:
    return [e for e in events if e[0] == "execve"]


class _Stream:
    """A stdout / stderr stand-in that records its flushes among the exec events."""

    def __init__(self, name: str, events: list) -> None:
        self.name, self.events = name, events

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        self.events.append(("flush", self.name))


def test_reexec_restarts_the_same_command_with_the_tuned_allocator(execve, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_TEST_KEEP", "kept")
    with monkeypatch.context() as streams:  # inside the test: pytest's capture owns the setup's
        streams.setattr(sys, "stdout", _Stream("stdout", execve))
        streams.setattr(sys, "stderr", _Stream("stderr", execve))
        reexec_with_tuned_malloc()
    (call,) = _execs(execve)
    _, path, argv, env = call
    assert path == sys.executable
    assert argv == [sys.executable, "-X", "utf8", "train/distill.py", "seed=3"]
    assert {k: env[k] for k in TUNED_MALLOC} == TUNED_MALLOC
    assert env[MALLOC_SWITCH] == "tuned"  # the restarted process does not restart again
    assert env["DRAFTSMITH_TEST_KEEP"] == "kept"  # the rest of the environment is passed on
    assert execve[:2] == [("flush", "stdout"), ("flush", "stderr")]  # no buffered output lost


@pytest.mark.parametrize("switch", ["off", "tuned"])
def test_reexec_is_a_no_op_when_switched_off_or_already_tuned(execve, monkeypatch, switch):
    monkeypatch.setenv(MALLOC_SWITCH, switch)
    reexec_with_tuned_malloc()
    assert _execs(execve) == []


def test_reexec_leaves_the_users_own_malloc_settings_alone(execve, monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "4096")
    reexec_with_tuned_malloc()
    assert _execs(execve) == []


def test_reexec_is_linux_only(execve, monkeypatch):
    monkeypatch.setattr(malloc.sys, "platform", "darwin")
    reexec_with_tuned_malloc()
    assert _execs(execve) == []


@pytest.mark.parametrize(("name", "argv0", "restarts"), [
    ("__main__", "train/distill.py", True),  # run by path, or python -m
    ("draftsmith.train.distill", "/venv/bin/draftsmith-distill", True),  # the console script
    ("draftsmith.train.distill", "/venv/bin/pytest", False),  # imported by another program
    ("draftsmith.train.distill", "/venv/bin/draftsmith-bench-train", False),  # another command
])
def test_a_command_restarts_when_started_as_itself_only(execve, monkeypatch, name, argv0,
                                                        restarts):
    monkeypatch.setattr(sys, "argv", [argv0, "seed=3"])
    restart_as_command(name, "draftsmith-distill")
    assert len(_execs(execve)) == int(restarts)


def test_a_command_restarts_with_bounded_matmul_shape_caches(execve, monkeypatch):
    """The restarted command caps oneDNN's and ideep's per-shape caches (``SHAPE_CACHES``;
    tests/train/test_trim.py measures the growth the caps stop); a value the user set stays."""
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "4096")
    monkeypatch.setattr(sys, "argv", ["train/distill.py", "seed=3"])
    restart_as_command("__main__", "draftsmith-distill")
    env = _execs(execve)[0][3]
    cap = SHAPE_CACHES["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
    assert int(cap) < 1024  # below the libraries' default
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == cap
    assert env["LRU_CACHE_CAPACITY"] == "4096"


def test_malloc_imports_nothing_heavy():
    """The restart runs before the commands' other imports: its module needs the standard
    library only (a fresh interpreter, so modules this test process loaded do not count)."""
    import subprocess

    code = ("import sys; import draftsmith.data.malloc; "
            "print(sorted(m for m in ('torch', 'hydra', 'omegaconf', 'numpy', 'transformers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_tuned_malloc_disables_mmap_and_trimming():
    assert TUNED_MALLOC["MALLOC_MMAP_MAX_"] == "0"
    assert int(TUNED_MALLOC["MALLOC_TRIM_THRESHOLD_"]) >= 1 << 40  # never trims in practice


# ----- cpu_threads -----------------------------------------------------------------------------
def test_cpu_threads_divides_the_usable_cores_among_the_local_processes(monkeypatch):
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cpu_threads(None) == 8
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert cpu_threads(None) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # this node's processes, not the world's
    assert cpu_threads(None) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert cpu_threads(None) == 1
    assert cpu_threads(3) == 3  # an explicit request wins


def test_cpu_threads_without_affinity_uses_the_cpu_count(monkeypatch):
    monkeypatch.delattr(runtime.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert cpu_threads(None) == 2


# ----- make_accelerator and the launch check ---------------------------------------------------
def _cfg(launcher: str = "single", mixed_precision: str = "no", tmp_path=None):
    launchers = {
        "single": {"name": "single", "num_processes": 1, "distributed_type": ["NO"],
                   "accelerate_config": "conf/accelerate/single.yaml"},
        "ddp": {"name": "ddp", "num_processes": 2, "distributed_type": ["MULTI_GPU", "MULTI_CPU"],
                "accelerate_config": "conf/accelerate/ddp.yaml"},
        "fsdp": {"name": "fsdp", "num_processes": 2, "distributed_type": ["FSDP"],
                 "accelerate_config": "conf/accelerate/fsdp.yaml"},
    }
    return OmegaConf.create({
        "name": "test", "out_dir": str(tmp_path or "."),
        "train": {"grad_accum": 1, "mixed_precision": mixed_precision, "cpu_threads": 2},
        "logging": {"log_with": "none", "project": "p"},
        "launcher": launchers[launcher]})


@pytest.fixture
def fresh_accelerate_state(monkeypatch):
    from accelerate.state import AcceleratorState

    threads: list[int] = []
    monkeypatch.setattr(runtime.torch, "set_num_threads", threads.append)
    AcceleratorState._reset_state(True)
    yield threads
    AcceleratorState._reset_state(True)


cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only recipes")


@cpu_only
def test_single_process_accelerator_is_built_and_checked(fresh_accelerate_state, tmp_path,
                                                         monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    acc = make_accelerator(_cfg(tmp_path=tmp_path))
    assert acc.distributed_type.name == "NO" and acc.num_processes == 1
    assert fresh_accelerate_state == [2]  # train.cpu_threads applied on CPU


@cpu_only
def test_a_launcher_that_was_not_launched_is_refused_with_the_command(fresh_accelerate_state,
                                                                     tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"launcher=ddp expects distributed type .* launched NO "
                       r"with 1 process.*--config_file conf/accelerate/ddp.yaml"):
        make_accelerator(_cfg("ddp", tmp_path=tmp_path))


@cpu_only
def test_fp16_and_cpu_fsdp_are_refused_before_building(fresh_accelerate_state, monkeypatch):
    with pytest.raises(ConfigError, match="fp16 needs CUDA"):
        make_accelerator(_cfg(mixed_precision="fp16"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match="FSDP only on CUDA"):
        make_accelerator(_cfg("fsdp"))


def test_launch_check_compares_type_and_process_count():
    cfg = _cfg("ddp")
    ok = SimpleNamespace(distributed_type=SimpleNamespace(name="MULTI_CPU"), num_processes=2)
    runtime._check_launch(cfg, ok)
    three = SimpleNamespace(distributed_type=SimpleNamespace(name="MULTI_CPU"), num_processes=3)
    with pytest.raises(ConfigError, match="expects 2 processes but 3 were launched; pass "
                       "--num_processes 2 or launcher.num_processes=3"):
        runtime._check_launch(cfg, three)
    cfg.launcher.num_processes = None  # any count accepted
    runtime._check_launch(cfg, three)


@cpu_only
def test_deepspeed_on_cpu_skips_building_the_shm_all_reduce_kernel(monkeypatch):
    """The kernel DeepSpeed's CPU backend would compile at start-up is marked incompatible, so
    ``build_shm_op`` (what its backend calls) builds nothing; without the skip it builds."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    builder = type(get_accelerator().create_op_builder("ShareMemCommBuilder"))
    built = []
    monkeypatch.setattr(builder, "load", lambda self, *a, **k: built.append(self.NAME) or "op")
    monkeypatch.setattr(deepspeed.ops, "__compatible_ops__",
                        {**deepspeed.ops.__compatible_ops__, builder.NAME: True})
    assert build_shm_op() == "op" and built == [builder.NAME]  # what start-up would do
    runtime.skip_deepspeed_shm_op()
    assert build_shm_op() is None and built == [builder.NAME]


# ----- make_epoch_loader -----------------------------------------------------------------------
class _Numbered(torch.utils.data.Dataset):
    """Sequence i holds token id i (twice), so a batch names the sequences it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor([i, i]), "loss_mask": torch.tensor([False, True]),
                "hidden": torch.full((2, 4), float(i), dtype=torch.float16)}


def _epoch(n: int = 8, batch: int = 2, processes: int = 1, rank: int = 0,
           **kw) -> list[list[int]]:
    acc = SimpleNamespace(device=torch.device("cpu"), num_processes=processes, process_index=rank)
    loader = make_epoch_loader(_Numbered(n), batch, accelerator=acc, **kw)
    return [b["input_ids"][:, 0].tolist() for b in loader]


def test_epoch_loader_order_is_a_function_of_seed_and_epoch():
    first = _epoch(seed=1, epoch=0, shuffle=True)
    assert sorted(i for b in first for i in b) == list(range(8))  # every sequence once
    assert _epoch(seed=1, epoch=0, shuffle=True) == first  # the same on every process and rerun
    assert _epoch(seed=1, epoch=1, shuffle=True) != first  # a new order each epoch
    assert _epoch(seed=1, epoch=0, shuffle=False) == [[0, 1], [2, 3], [4, 5], [6, 7]]


class _Lengths(_Numbered):
    """Sequence i is i + 1 tokens long (token id i)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.full((i + 1,), i), "loss_mask": torch.ones(i + 1, dtype=bool),
                "hidden": torch.zeros(i + 1, 4, dtype=torch.float16)}

    def lengths(self) -> list[int]:
        return [i + 1 for i in range(self.n)]


def test_bucketed_batches_hold_similar_lengths_in_a_seeded_random_order():
    acc = SimpleNamespace(device=torch.device("cpu"), num_processes=1, process_index=0)

    def epoch(k: int, seed: int = 3, epoch: int = 0, batch: int = 4, skip: int = 0):
        loader = make_epoch_loader(_Lengths(64), batch, seed=seed, epoch=epoch, shuffle=True,
                                   accelerator=acc, bucket_batches=k, skip=skip)
        return [b["input_ids"][:, 0].tolist() for b in loader]

    def padding(batches):  # padded slots over all slots
        return 1 - sum(sum(i + 1 for i in b) for b in batches) / sum(
            len(b) * (max(b) + 1) for b in batches)

    plain, bucketed = epoch(0), epoch(4)
    assert sorted(i for b in bucketed for i in b) == list(range(64))  # every sequence once
    assert padding(bucketed) < 0.6 * padding(plain)
    assert epoch(4) == bucketed and epoch(4, epoch=1) != bucketed  # a function of seed, epoch
    assert epoch(4, skip=5) == bucketed[5:]  # resumes mid-epoch
    shortest = [min(b) for b in bucketed]
    assert sorted(shortest) != shortest  # batches come shuffled, not sorted by length
    # the global batch is the unit: 2 processes x 2 see the batches of 1 process x 4
    r0, r1 = ([b["input_ids"][:, 0].tolist() for b in make_epoch_loader(
        _Lengths(64), 2, seed=3, epoch=0, shuffle=True, bucket_batches=4,
        accelerator=SimpleNamespace(device=torch.device("cpu"), num_processes=2,
                                    process_index=rank))] for rank in (0, 1))
    assert [a + b for a, b in zip(r0, r1)] == bucketed


def test_epoch_loader_collates_padded_feature_batches():
    acc = SimpleNamespace(device=torch.device("cpu"), num_processes=1, process_index=0)
    batch = next(iter(make_epoch_loader(_Numbered(4), 2, seed=0, epoch=0, shuffle=False,
                                        accelerator=acc)))
    assert batch["hidden"].shape == (2, 2, 4) and batch["hidden"].dtype == torch.float16
    assert batch["loss_mask"].tolist() == [[False, True]] * 2
    assert batch["attention_mask"].tolist() == [[1, 1]] * 2


def test_epoch_loader_skip_resumes_mid_epoch_and_drop_last():
    full = _epoch(seed=4, epoch=2, shuffle=True)
    assert _epoch(seed=4, epoch=2, shuffle=True, skip=3) == full[3:]
    assert len(_epoch(n=7, seed=0, epoch=0, shuffle=False)) == 3  # the ragged batch dropped
    assert _epoch(n=7, seed=0, epoch=0, shuffle=False, drop_last=False)[-1] == [6]


def test_epoch_loader_shards_batches_across_processes():
    whole = _epoch(seed=2, epoch=0, shuffle=True)
    ranks = [_epoch(seed=2, epoch=0, shuffle=True, processes=2, rank=r) for r in (0, 1)]
    assert ranks[0] == whole[0::2] and ranks[1] == whole[1::2]


# ----- cosine_with_warmup ----------------------------------------------------------------------
def _lrs(warmup: int, total: int, min_ratio: float, steps: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = cosine_with_warmup(opt, warmup, total, min_ratio)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    lrs = _lrs(3, 9, 0.1, 13)
    want = [2 / 3, 4 / 3, 2.0, 2.0, None, None, 2 * 0.55, None, None, 0.2, 0.2, 0.2, 0.2]
    for step, (got, w) in enumerate(zip(lrs, want)):
        if w is not None:
            assert got == pytest.approx(w), step
    assert all(a > b for a, b in itertools.pairwise(lrs[3:10]))  # decreasing to the floor
    mid = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 2 / 6))
    assert lrs[5] == pytest.approx(2 * mid)


def test_schedule_without_warmup_starts_at_the_peak():
    assert _lrs(0, 4, 0.0, 5) == pytest.approx([2.0, 2 * 0.5 * (1 + math.cos(math.pi / 4)), 1.0,
                                                2 * 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0])


# ----- StepLog ---------------------------------------------------------------------------------
class _FakeAccelerator:
    def __init__(self, main: bool = True) -> None:
        self.is_main_process = main
        self.logged: list[tuple[dict, int]] = []
        self.trackers: list[tuple] = []

    def log(self, values: dict, step: int) -> None:
        self.logged.append((values, step))

    def init_trackers(self, project: str, config: dict, init_kwargs: dict) -> None:
        self.trackers.append((project, config, init_kwargs))


def test_step_log_writes_jsonl_and_the_tracker(tmp_path):
    acc = _FakeAccelerator()
    log = StepLog(acc, _cfg(), tmp_path)
    assert acc.trackers == []  # log_with=none: no tracker
    log.log_train(5, {"loss": 1.5, "lr": 0.1})
    log.log_validation(5, {"alpha_hat": [0.5, 0.25], "top1": [0.75, 0.5]})
    records = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert records == [{"step": 5, "loss": 1.5, "lr": 0.1},
                       {"step": 5, "tag": "val", "alpha_hat": [0.5, 0.25], "top1": [0.75, 0.5]}]
    assert acc.logged[0] == ({"loss": 1.5, "lr": 0.1}, 5)
    assert acc.logged[1] == ({"val/alpha_hat_pos1": 0.5, "val/alpha_hat_pos2": 0.25,
                              "val/top1_pos1": 0.75, "val/top1_pos2": 0.5}, 5)


def test_step_log_writes_nothing_on_other_ranks(tmp_path):
    log = StepLog(_FakeAccelerator(main=False), _cfg(), tmp_path)
    log.log_train(1, {"loss": 2.0})
    log.log_validation(1, {"alpha_hat": [0.1], "top1": [0.2]}, tag="init")
    assert not (tmp_path / "train_log.jsonl").exists()


def test_step_log_starts_the_tracker_with_the_flat_scalar_config(tmp_path):
    acc = _FakeAccelerator()
    cfg = _cfg()
    cfg.logging.log_with = "tensorboard"
    cfg.train.extra = {"layers": [1, 2], "deep": {"x": 3}}
    StepLog(acc, cfg, tmp_path)
    ((project, config, kwargs),) = acc.trackers
    assert project == "p" and kwargs == {"wandb": {"name": "test"}}
    assert config["train.extra.deep.x"] == 3 and config["launcher.name"] == "single"
    assert "train.extra.layers" not in config  # lists are not tracker hyper-parameters
    assert runtime._flatten({"a": {"b": {"c": 1}}, "d": 2}) == {"a.b.c": 1, "d": 2}
