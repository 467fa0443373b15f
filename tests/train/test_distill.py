"""The distillation recipe end to end on a tiny random target with the real tokenizer.

Fast tests run the recipe in-process; the multi-process ones (DDP, DeepSpeed ZeRO-2) and the
SIGKILL resume launch ``accelerate launch train/distill.py`` for real and are marked ``slow``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.train.launching import (
    PARITY,
    REPO,
    TINY,
)
from tests.train.launching import assert_resumed as _assert_resumed
from tests.train.launching import assert_same as _assert_same
from tests.train.launching import compose_config as _compose
from tests.train.launching import launch as _launch
from tests.train.launching import log_rows as _log_rows
from tests.train.launching import run_inprocess as _run_inprocess
from tests.train.launching import weights as _weights


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """Build the tiny target and its feature cache once (later runs reuse them)."""
    out = tmp_path_factory.mktemp("warm")
    _run_inprocess(TINY + ["draft=medusa", "train.max_steps=1", f"out_dir={out}"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lm", "medusa", "eagle"])
def test_each_family_learns(kind, warm_cache, tmp_path):
    out = tmp_path / kind
    sized = ["draft.config.num_layers=1"] if kind == "lm" else []  # the tiny target has 2 layers
    summary = _run_inprocess(TINY + sized + [f"draft={kind}", "train.max_steps=30",
                                             "train.eval_every=30", "train.save_every=30",
                                             "optim.lr=3e-3", f"out_dir={out}"])
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, f"loss did not decrease: {losses}"
    init, final = summary["alpha_hat_init"], summary["alpha_hat"]
    assert final[0] > init[0] + 0.02, f"alpha-hat did not improve: {init} -> {final}"
    assert (out / "draft" / "manifest.json").is_file()
    from draftsmith.heads.package import load_package

    pkg = load_package(out / "draft")
    assert pkg.family.name == kind
    # token_frequency.json (heads/vocab.py): the loss-masked target ids of the training split
    freq = json.loads((out / "draft" / "token_frequency.json").read_text())
    report = json.loads((out / "draft" / "data_report.json").read_text())
    assert 0 < freq["total"] < report["train"]["tokens"] and sum(freq["counts"]) == freq["total"]
    assert freq["counts"] == sorted(freq["counts"], reverse=True)


def test_token_frequency_script_recounts_what_training_wrote(warm_cache, tmp_path):
    import shutil

    from draftsmith.data.feature_data import FeatureDataset
    from draftsmith.data.prepare import default_feature_root
    from draftsmith.heads.package import load_package, update_package_json
    from draftsmith.scripts.token_frequency import add_token_frequency

    src = warm_cache / "draft"
    want = json.loads((src / "token_frequency.json").read_text())
    key = json.loads((src / "data_report.json").read_text())["key"]
    train_dir = default_feature_root() / key / "train"
    data = FeatureDataset(train_dir)
    by_item = torch.zeros(want["vocab_size"], dtype=torch.long)
    for i in range(len(data)):  # the shard-level count equals counting item by item
        item = data[i]
        by_item += torch.bincount(item["input_ids"][item["loss_mask"].bool()],
                                  minlength=len(by_item))
    assert torch.equal(data.token_counts(want["vocab_size"]), by_item)
    for kwargs in ({}, {"train_cache": train_dir}):  # rebuilt from the config, or a named cache
        pkg = tmp_path / f"pkg{len(kwargs)}"
        shutil.copytree(src, pkg)
        update_package_json(pkg, "token_frequency.json", {})  # as if it had been left out
        add_token_frequency(pkg, **kwargs)
        assert json.loads((pkg / "token_frequency.json").read_text()) == want
        load_package(pkg)  # the manifest entry was updated with it


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_init_from_continues_from_a_package(kind, warm_cache, tmp_path):
    first = _run_inprocess(TINY + [f"draft={kind}", "train.max_steps=6", "train.eval_every=6",
                                   "train.save_every=6", "optim.lr=3e-3",
                                   f"out_dir={tmp_path / 'a'}"])
    pkg = tmp_path / "a" / "draft"
    second = _run_inprocess(TINY + [f"draft={kind}", f"draft.init_from={pkg}", "train.max_steps=1",
                                    f"out_dir={tmp_path / 'b'}"])
    # the continued run starts where the first ended: same validation before its first step
    assert second["alpha_hat_init"] == pytest.approx(first["alpha_hat"], abs=1e-6)
    assert first["alpha_hat"] != pytest.approx(first["alpha_hat_init"], abs=1e-3)
    other = "medusa" if kind == "eagle" else "eagle"
    with pytest.raises(ValueError, match=f"holds a '{kind}' draft"):
        _run_inprocess(TINY + [f"draft={other}", f"draft.init_from={pkg}", "train.max_steps=1",
                               f"out_dir={tmp_path / 'c'}"])


def test_a_draft_lm_starts_from_a_sibling_model_sharing_the_vocabulary(warm_cache, tmp_path):
    """draft.init_from=<a model folder>: the draft LM is that whole model (a smaller sibling of
    the target with its tokenizer), trained on; its package holds the sibling's shape."""
    from draftsmith.data.tiny import tiny_target_dir
    from draftsmith.heads.package import load_package

    sibling = tiny_target_dir(num_layers=1, seed=5, initializer_range=0.3)
    out = tmp_path / "sib"
    summary = _run_inprocess(TINY + ["draft=lm", f"draft.init_from={sibling}",
                                     "train.max_steps=2", f"out_dir={out}"])
    pkg = load_package(out / "draft")
    assert pkg.family.name == "lm" and pkg.module.config.num_hidden_layers == 1
    assert pkg.head_config.init == "model" and summary["alpha_hat_init"] != summary["alpha_hat"]
    start = load_target_weights(sibling)
    trained = pkg.module.state_dict()
    assert set(start) <= set(trained)  # the sibling's weights, moved by two steps
    assert any(not torch.equal(start[k], trained[k]) for k in start if start[k].is_floating_point())


def load_target_weights(folder) -> dict:
    return load_file(str(folder / "model.safetensors"))


def test_nan_loss_stops_and_keeps_last_checkpoint(warm_cache, tmp_path):
    from draftsmith.train.checkpoint import latest_checkpoint
    from draftsmith.train.distill import NonFiniteLossError

    out = tmp_path / "nan"
    # An absurd learning rate blows the weights up after the first update: the next loss is
    # not finite and the run must stop before touching the weights again.
    with pytest.raises(NonFiniteLossError, match=r"at step \d+.*last good checkpoint"):
        _run_inprocess(TINY + ["draft=medusa", "train.max_steps=20", "train.save_every=1",
                               "optim.lr=1e30", "optim.warmup_steps=0", "train.max_grad_norm=0",
                               f"out_dir={out}"])
    last = latest_checkpoint(out)
    assert last is not None, "the checkpoint written before the failure is gone"
    state = load_file(str(last / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in state.values())
    assert not list((out / "checkpoints").glob("*.tmp"))


def test_bad_config_fails_before_work(tmp_path):
    from draftsmith.train.config import ConfigError

    with pytest.raises(ConfigError, match="optim.lr"):
        _run_inprocess(TINY + ["optim.lr=-1", f"out_dir={tmp_path}"])
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted(warm_cache, tmp_path):
    common = TINY + ["draft=eagle", "train.max_steps=8", "train.save_every=3", "train.eval_every=8",
                     "seed=3"]
    ref = tmp_path / "ref"
    _launch(["--config_file", "conf/accelerate/single.yaml"], ref, common, port=29611)

    run = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "train/distill.py", *common, f"out_dir={run}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while not (run / "checkpoints" / "step-000003" / "trainer_state.json").exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "draft").exists(), "killed too late: the run had already finished"

    from draftsmith.train.checkpoint import latest_checkpoint

    ckpt, logged = latest_checkpoint(run), _log_rows(run)
    proc = _launch(["--config_file", "conf/accelerate/single.yaml"], run, common, port=29612)
    _assert_resumed(proc.stdout + proc.stderr, _log_rows(run)[len(logged):], ckpt, last_step=8)
    _assert_same(_weights(run), _weights(ref), atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["resume", "no-op resume", "wrong step"])
def test_resume_check_catches_a_run_that_did_not_resume(variant, warm_cache, tmp_path,
                                                        monkeypatch, caplog):
    """Twin of the SIGKILL test's resume check, in process: the real resume passes it; a resume
    that does nothing, or one that loads the checkpoint under a wrong step, fails it."""
    import logging

    from draftsmith.train import checkpoint, distill

    common = TINY + ["draft=medusa", "train.save_every=3", "train.eval_every=5", "seed=3",
                     f"out_dir={tmp_path}"]
    _run_inprocess(common + ["train.max_steps=3"])
    ckpt, logged = checkpoint.latest_checkpoint(tmp_path), _log_rows(tmp_path)
    if variant == "no-op resume":
        monkeypatch.setattr(distill.DistillRecipe, "_resume", lambda self: None)
    elif variant == "wrong step":
        real = checkpoint.load_trainer_state
        monkeypatch.setattr(checkpoint, "load_trainer_state",
                            lambda path: {**real(path), "step": real(path)["step"] - 1})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="draftsmith.distill"):
        _run_inprocess(common + ["train.max_steps=5"])
    args = (caplog.text, _log_rows(tmp_path)[len(logged):], ckpt, 5)
    if variant == "resume":
        _assert_resumed(*args)
        return
    with pytest.raises(AssertionError, match=r"did not log 'resumed from \.\.\./step-000003 "
                                             r"\(step 3, \.\.\.\)'"):
        _assert_resumed(*args)
    # the step counter catches it too, even next to a (forged) right log line
    forged = f"resumed from {ckpt} (step 3, epoch 0, batch 6)"
    trained = {"no-op resume": "[1, 2, 3, 4, 5]", "wrong step": "[3, 4, 5]"}[variant]
    with pytest.raises(AssertionError, match=re.escape(
            f"the relaunch trained steps {trained}, not 4..5 after the checkpoint of step 3")):
        _assert_resumed(forged, *args[1:])


def test_resume_from_branches_another_runs_checkpoint(warm_cache, tmp_path, monkeypatch):
    """train.resume_from: a new out_dir continues run A's step-2 checkpoint to step 4: A's
    step-4 weights, A's log rows (the branch's own rows are steps 3 and 4 only), A untouched.
    Twin: a branch that copies the log but not the checkpoint trains from step 0 (the same
    seed: the same weights) and is caught by its log's steps."""
    from draftsmith.train import checkpoint

    common = TINY + ["draft=medusa", "train.save_every=2", "train.eval_every=2", "seed=5",
                     "train.max_steps=4", "train.keep_checkpoints=5", "train.log_every=1"]
    a = tmp_path / "a"
    _run_inprocess(common + [f"out_dir={a}"])
    src = a / "checkpoints" / "step-000002"
    before = sorted(str(p.relative_to(a)) for p in a.rglob("*"))
    real = checkpoint.branch_from
    for variant, want in (("branch", [1, 2, 3, 4]), ("log-only", [1, 2, 1, 2, 3, 4])):
        if variant == "log-only":  # the log and init validation stay, the checkpoint goes
            monkeypatch.setattr(checkpoint, "branch_from",
                                lambda source, out_dir: shutil.rmtree(real(source, out_dir)))
        b = tmp_path / variant
        _run_inprocess(common + [f"out_dir={b}", f"train.resume_from={src}"])
        _assert_same(_weights(b), _weights(a), atol=0)
        assert sorted(str(p.relative_to(a)) for p in a.rglob("*")) == before
        assert [r["step"] for r in _log_rows(b) if "loss" in r] == want, variant
    assert [r["step"] for r in _log_rows(a) if "loss" in r] == [1, 2, 3, 4]


def test_resume_from_refuses_a_folder_that_is_no_checkpoint_or_another_config(warm_cache,
                                                                            tmp_path):
    from draftsmith.train import checkpoint
    from draftsmith.train.config import ConfigError

    common = TINY + ["draft=medusa", "train.max_steps=1"]  # warm_cache's run
    src = checkpoint.latest_checkpoint(warm_cache)
    with pytest.raises(ConfigError, match=r"train.resume_from=.*is not a training checkpoint"):
        _run_inprocess(common + [f"out_dir={tmp_path / 'c'}", f"train.resume_from={warm_cache}"])
    with pytest.raises(ConfigError, match=r"optim.lr: checkpoint"):
        _run_inprocess(common + [f"out_dir={tmp_path / 'd'}", "optim.lr=0.5",
                                 f"train.resume_from={src}"])
    with pytest.raises(ConfigError, match=r"with train.resume=false"):
        _run_inprocess(common + [f"out_dir={tmp_path / 'e'}", "train.resume=false",
                                 f"train.resume_from={src}"])
    assert not (tmp_path / "d" / "checkpoints").exists()  # refused before anything was linked


@pytest.mark.slow
@pytest.mark.xdist_group("parity")  # one worker: the one-process reference is shared
def test_ddp_and_zero2_match_one_process(warm_cache, one_process_reference, tmp_path):
    # PARITY: the same global batch (4 sequences) as the one-process reference (conftest.py)
    ddp = tmp_path / "ddp"
    _launch(["--config_file", "conf/accelerate/ddp.yaml"], ddp,
            PARITY + ["launcher=ddp", "train.micro_batch_size=2"], port=29622)
    zero2 = tmp_path / "zero2"
    proc = _launch(["--config_file", "conf/accelerate/deepspeed_zero2.yaml"], zero2,
                   PARITY + ["launcher=deepspeed_zero2", "train.micro_batch_size=2"], port=29623)
    # DeepSpeed's shm all-reduce kernel (inference only) is neither built nor loaded: DeepSpeed
    # prints this line whenever it loads the op
    assert "deepspeed_shm_comm_op built" not in proc.stdout + proc.stderr

    s_ddp = json.loads((ddp / "summary.json").read_text())
    s_zero = json.loads((zero2 / "summary.json").read_text())
    assert (s_ddp["distributed_type"], s_ddp["num_processes"]) == ("MULTI_CPU", 2)
    assert (s_zero["distributed_type"], s_zero["num_processes"]) == ("DEEPSPEED", 2)
    for s in (s_ddp, s_zero):
        fp = s["rank_batch_fingerprints"]
        assert len(fp) == 2 and fp[0] != fp[1], f"ranks saw the same data: {fp}"
    ref = _weights(one_process_reference)
    _assert_same(_weights(ddp), ref, atol=1e-5)
    _assert_same(_weights(zero2), ref, atol=1e-5)


@pytest.mark.slow
def test_launcher_mismatch_is_refused(tmp_path):
    proc = _launch(["--config_file", "conf/accelerate/single.yaml"], tmp_path,
                   TINY + ["launcher=ddp"], port=29631, check=False)
    assert proc.returncode != 0
    assert "launcher=ddp expects distributed type" in proc.stderr + proc.stdout


def test_cpu_threads_default_uses_the_cores_of_this_machine(monkeypatch):
    from draftsmith.train.runtime import cpu_threads

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what `accelerate launch` exports by default
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cpu_threads(None) == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cores))  # more processes than cores
    assert cpu_threads(None) == 1
    assert cpu_threads(3) == 3


def _recipe(overrides: list[str]):
    from accelerate.state import AcceleratorState

    from draftsmith.train.distill import DistillRecipe

    AcceleratorState._reset_state(True)
    recipe = DistillRecipe(_compose(overrides))
    recipe.setup()
    return recipe


def _loss_and_grads(recipe, batch, per_token: bool, fused: bool):
    recipe.cfg.train.teacher_per_token = per_token
    recipe.objective.loss_fn.fused = fused
    recipe.optimizer.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same EAGLE feature noise on both paths
    loss, parts, _ = recipe.objective(batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in recipe.draft.module.named_parameters()
             if p.grad is not None}
    return loss.item(), parts, grads


def _old_and_new_paths(overrides: list[str]):
    """(loss, parts, grads) of one batch on the old path, then on the fast path."""
    recipe = _recipe(overrides)
    try:
        batch = next(recipe._batches())
        return (_loss_and_grads(recipe, batch, False, False),
                _loss_and_grads(recipe, batch, True, True))
    finally:
        recipe.cleanup()


FAST_PATH_CASES = {
    "lm": ["draft=lm", "draft.config.num_layers=1"],
    "medusa": ["draft=medusa"],
    "eagle": ["draft=eagle"],
    "eagle3": ["draft=eagle", "draft.config.draft_vocab_size=48", "draft.feature_weight=0",
               "draft.config.fuse_layers=[0,1,2]", "loss=mix"],
    # fkl at temperature 1 over a reduced vocabulary: the teacher from the cached normaliser
    "eagle3-fkl": ["draft=eagle", "draft.config.draft_vocab_size=48", "draft.feature_weight=0",
                   "draft.config.fuse_layers=[0,1,2]", "loss=fkl"],
}


@pytest.mark.parametrize("case", sorted(FAST_PATH_CASES))
def test_one_teacher_per_token_gives_the_per_position_losses_and_gradients(case, warm_cache,
                                                                           tmp_path):
    """The fast path (shared teacher rows, fused KL) against the old one (a teacher per
    position, autograd through log_softmax) on the same batch: same loss, same gradients."""
    (old_loss, old_parts, old_grads), (new_loss, new_parts, new_grads) = _old_and_new_paths(
        TINY + FAST_PATH_CASES[case] + [f"out_dir={tmp_path}"])
    assert new_loss == pytest.approx(old_loss, rel=1e-5)
    assert new_parts.keys() == old_parts.keys()
    for k in old_parts:
        assert new_parts[k] == pytest.approx(old_parts[k], rel=1e-5, abs=1e-6)
    assert old_grads.keys() == new_grads.keys() and old_grads
    for n, g in old_grads.items():
        assert torch.allclose(new_grads[n], g, rtol=1e-4, atol=1e-6), n


def test_the_cached_normaliser_path_fails_with_a_misaligned_normaliser(warm_cache, tmp_path):
    """Twin of the eagle3-fkl case: with each token's cached teacher normaliser taken from the
    next token, the fast path's loss is no longer the old path's."""
    recipe = _recipe(TINY + FAST_PATH_CASES["eagle3-fkl"] + [f"out_dir={tmp_path}"])
    try:
        batch = next(recipe._batches())
        assert "teacher_lse" in batch
        old_loss = _loss_and_grads(recipe, batch, False, False)[0]
        same = _loss_and_grads(recipe, batch, True, True)[0]
        batch["teacher_lse"] = batch["teacher_lse"].roll(-1, dims=1)
        wrong = _loss_and_grads(recipe, batch, True, True)[0]
    finally:
        recipe.cleanup()
    assert same == pytest.approx(old_loss, rel=1e-5)
    assert wrong != pytest.approx(old_loss, rel=1e-3)


def test_shared_teacher_equality_fails_when_teacher_rows_are_misaligned(warm_cache, tmp_path,
                                                                       monkeypatch):
    """Twin: with the teacher row of each EAGLE position off by one token, the fast path's loss
    is no longer the per-position one (the comparison above can fail)."""
    from draftsmith.heads import blocks, eagle_ttt

    monkeypatch.setattr(eagle_ttt, "teacher_rows",
                        lambda b, t, s, device: blocks.teacher_rows(b, t, s + 1, device))
    (old_loss, _, _), (new_loss, _, _) = _old_and_new_paths(
        TINY + ["draft=eagle", f"out_dir={tmp_path}"])
    assert new_loss != pytest.approx(old_loss, rel=1e-3)


def test_auto_dtypes_resolve_to_the_measured_fastest(monkeypatch, tmp_path):
    from draftsmith.data import dtype
    from draftsmith.train.config import resolve_auto_dtypes

    for fast, want_mp in (("bfloat16", "bf16"), ("float32", "no")):
        monkeypatch.setattr(dtype, "fastest_dtype", lambda device="cpu", f=fast: f)
        cfg = _compose(TINY + ["target.dtype=auto", "train.mixed_precision=auto",
                               f"out_dir={tmp_path}"])
        resolve_auto_dtypes(cfg)
        assert (cfg.target.dtype, cfg.train.mixed_precision) == (fast, want_mp)
    cfg = _compose(TINY + ["target.dtype=float32", "train.mixed_precision=bf16"])
    resolve_auto_dtypes(cfg)  # explicit values stay
    assert (cfg.target.dtype, cfg.train.mixed_precision) == ("float32", "bf16")


def test_bad_target_dtype_is_refused_naming_the_choices(tmp_path):
    from draftsmith.train.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match="target.dtype"):
        validate_config(_compose(TINY + ["target.dtype=fp8", f"out_dir={tmp_path}"]))


@pytest.mark.slow
def test_distill_restarts_itself_with_the_tuned_allocator(tmp_path):
    """`python train/distill.py` re-executes once with glibc's mmap/trim settings (logged as
    malloc=tuned); DRAFTSMITH_MALLOC=off keeps the default allocator."""
    args = [sys.executable, "train/distill.py", *TINY, "draft=medusa", "train.max_steps=1",
            "train.eval_every=1", "train.save_every=1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("DRAFTSMITH_MALLOC", None)
    tuned = subprocess.run([*args, f"out_dir={tmp_path / 'a'}"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=600, check=False)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert "malloc=tuned" in tuned.stdout + tuned.stderr
    plain = subprocess.run([*args, f"out_dir={tmp_path / 'b'}"], cwd=REPO,
                           env={**env, "DRAFTSMITH_MALLOC": "off"}, capture_output=True,
                           text=True, timeout=600, check=False)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "malloc=off" in plain.stdout + plain.stderr
