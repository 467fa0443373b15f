"""make peers without the peers' environments: the equal-settings mapping (draftsmith's config
composed with it, speculators' arguments) and the offline formats written for the peers."""
from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file

from draftsmith.heads.blocks import teacher_mask
from draftsmith.scripts import peers_data, peers_train
from draftsmith.scripts.peers_specforge import specforge_config
from draftsmith.scripts.tooling import REPO


def _cfg(**over):
    with initialize_config_dir(config_dir=str(REPO / "conf" / "eval"), version_base="1.3"):
        return compose(config_name="peers", overrides=[f"{k}={v}" for k, v in over.items()])


def test_peers_config_composes_and_its_settings_validate():
    s = peers_train.equal_settings(_cfg())
    assert s.position_weights == pytest.approx([1.0, 0.8, 0.64])
    for key, bad, match in (("steps", 0, "steps=0"), ("warmup_steps", 500, "warmup_steps=500"),
                            ("precision", "fp8", "precision='fp8'"),
                            ("trainers", "[draftsmith,nope]", "trainers=")):
        with pytest.raises(ValueError, match=match):
            peers_train.equal_settings(_cfg(**{key: bad}))


def test_draftsmith_overrides_set_the_equal_settings_in_the_composed_recipe(tmp_path):
    s = peers_train.equal_settings(_cfg(steps=37, lr=0.002, warmup_steps=5, decay=0.5,
                                        precision="fp32", threads=3, sequences_per_step=6))
    overrides = peers_train.draftsmith_overrides(s, "quickstart", tmp_path, "float32",
                                                 _cfg().recipe)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="distill", overrides=overrides)
    got = OmegaConf.to_container(cfg, resolve=True)
    assert got["train"]["max_steps"] == 37 and got["train"]["micro_batch_size"] == 6
    assert got["train"]["mixed_precision"] == "no" and got["train"]["cpu_threads"] == 3
    assert got["train"]["eval_every"] == got["train"]["save_every"] == 37  # not in the loop
    assert got["optim"]["lr"] == 0.002 and got["optim"]["optimizer"]["lr"] == 0.002
    assert got["optim"]["warmup_steps"] == 5 and got["optim"]["min_lr_ratio"] == 0.0
    assert got["optim"]["optimizer"]["betas"] == [0.9, 0.999]
    assert got["optim"]["optimizer"]["weight_decay"] == 0.0
    assert got["draft"]["num_positions"] == 3 and got["draft"]["config"]["ttt_steps"] == 3
    assert got["draft"]["position_weights"] == pytest.approx([1.0, 0.5, 0.25])
    assert got["draft"]["config"]["layout"] == "eagle3"
    assert got["draft"]["config"]["lm_head"] == "random"  # draftsmith's recipe beyond the preset
    assert got["data"]["features"] == "offline" and got["target"]["dtype"] == "float32"


def _flag(args: list[str], name: str) -> list[str]:
    i = args.index(name)
    end = next((j for j in range(i + 1, len(args)) if args[j].startswith("--")), len(args))
    return args[i + 1:end]


def test_speculators_arguments_carry_the_equal_settings(tmp_path):
    s = peers_train.equal_settings(_cfg(steps=50, lr=0.003, warmup_steps=4))
    data = {"data_path": "D", "d2t_path": "d2t.npy", "t2d_path": "t2d.npy", "max_length": 300,
            "mean_length": 200.0, "train_tokens": 20000, "train_data_ratio": 0.9}
    args = peers_train.speculators_args(s, data, tmp_path / "target", tmp_path / "ck",
                                        [27, 2, 15])
    assert _flag(args, "--target-layer-ids") == ["27", "2", "15"]  # fc's column order
    assert _flag(args, "--total-seq-len") == ["800"]  # 4 sequences of the mean length
    assert _flag(args, "--max-steps") == ["50"] and _flag(args, "--lr") == ["0.003"]
    assert _flag(args, "--scheduler-warmup-steps") == ["4"]
    assert _flag(args, "--ttt-steps") == ["3"] and _flag(args, "--ttt-step-loss-decay") == ["0.8"]
    assert _flag(args, "--optimizer") == ["adamw"] and _flag(args, "--weight-decay") == ["0.0"]
    assert _flag(args, "--loss-fn") == ["kl_div"] and _flag(args, "--scheduler-type") == ["cosine"]
    assert _flag(args, "--full-attention-indices") == ["0"]
    assert {"--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output"} <= set(args)
    assert _flag(args, "--hidden-states-dtype") == ["bfloat16"]
    assert int(_flag(args, "--epochs")[0]) * 20000 >= 50 * 800  # enough epochs for the steps
    with pytest.raises(ValueError, match="betas"):
        peers_train.speculators_args(peers_train.equal_settings(_cfg(betas="[0.9,0.95]")),
                                     data, tmp_path, tmp_path, [2, 15, 27])


NORM = torch.tensor([0.5, 2.0, 1.0, 3.0])  # the target's final norm weight


def _rms(x: torch.Tensor) -> torch.Tensor:
    return NORM * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


def _rows(n: int, seed: int = 0) -> list[peers_data.Row]:
    """Rows whose final state is the output of the norm, as a target's is."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        t = 9 + i
        mask = torch.zeros(t, dtype=torch.bool)
        mask[4:] = True
        rows.append(peers_data.Row(torch.randint(3, 50, (t,), generator=g), mask,
                                   torch.randn(t, 12, generator=g),
                                   _rms(3 * torch.randn(t, 4, generator=g))))
    return rows


def test_speculators_data_reads_back_and_counts_the_positions_draftsmith_counts(tmp_path):
    from datasets import load_from_disk

    train, val = _rows(3), _rows(2, seed=1)
    d2t = torch.tensor([0, 2, 3, 7])
    t2d = torch.zeros(50, dtype=torch.bool).index_fill_(0, d2t, True)
    info = peers_data.write_speculators(tmp_path, iter(train), iter(val), NORM, d2t, t2d,
                                        torch.float32)
    assert info["train_rows"] == 3 and info["rows"] == 5
    assert info["train_lengths"] == [len(r.input_ids) for r in train]
    assert info["train_masked"] == [int(peers_data.shift_mask_for_speculators(r.loss_mask).sum())
                                    for r in train]
    assert info["train_data_ratio"] == pytest.approx(0.6)
    ds = load_from_disk(info["data_path"])
    assert ds.format["type"] == "torch" and len(ds) == 5
    assert ds[4]["seq_len"] == len(val[1].input_ids)
    import numpy as np
    assert (np.load(info["d2t_path"]) + np.arange(4)).tolist() == d2t.tolist()  # offsets
    for i, row in enumerate(train + val):
        hs = load_file(f"{info['data_path']}/hidden_states/hs_{i}.safetensors")
        assert torch.equal(hs["token_ids"], row.input_ids) and torch.equal(ds[i]["input_ids"],
                                                                           row.input_ids)
        planes = hs["hidden_states"]
        assert planes.shape == (len(row.input_ids), 4, 4)  # 3 fused + the last
        assert torch.equal(planes[:, :3].flatten(1), row.fused)
        x = planes[:, -1]  # the trainer's final norm brings it back to the cached state
        torch.testing.assert_close(_rms(x), row.final, rtol=1e-4, atol=1e-4)
        # speculators' shift_batch drops the first position, and its step s counts the
        # mask from s on: the positions it counts are draftsmith's teacher_mask of step s + 1
        mask = ds[i]["loss_mask"][1:].bool()
        for s in range(3):
            theirs = mask[s:]
            ours = teacher_mask(row.loss_mask[None], None, s + 1)[0][: len(theirs)]
            assert torch.equal(theirs, ours)
            # the twin: the mask as draftsmith stores it counts other positions
            assert not torch.equal(row.loss_mask[1:][s:], ours)


def test_specforge_rows_count_the_positions_draftsmith_counts(tmp_path):
    rows = _rows(2)
    assert peers_data.write_specforge(tmp_path / "data", iter(rows), torch.float32) == 2
    got = torch.load(tmp_path / "data" / "data_1.ckpt")
    assert got["hidden_state"].shape == (1, 10, 4) and got["aux_hidden_state"].shape == (1, 10, 12)
    assert got["hidden_state"].dtype == torch.bfloat16  # its target head's dtype
    assert got["aux_hidden_state"].dtype == torch.float32 and torch.equal(
        got["aux_hidden_state"][0], rows[1].fused)
    assert torch.equal(got["input_ids"], rows[1].input_ids)
    # SpecForge's reader zeroes the last position, and its TTT step k counts the entry at j
    # (teacher p_{j+k+1}) by the mask shifted k more positions: draftsmith's teacher_mask of
    # step k + 1
    mask = got["loss_mask"].clone()
    mask[-1] = 0
    for k in range(3):
        theirs = peers_data.shift_mask(mask.bool(), k)
        ours = teacher_mask(rows[1].loss_mask[None], None, k + 1)[0]
        assert torch.equal(theirs, ours)
        # the twin: the mask as draftsmith stores it (or shifted once) counts other positions
        for unshifted in (rows[1].loss_mask, peers_data.shift_mask(rows[1].loss_mask, 1)):
            assert not torch.equal(peers_data.shift_mask(unshifted, k), ours)


class _Tied:
    def __init__(self, path):
        self.path = path
        self.model = type("M", (), {"config": type("C", (), {"tie_word_embeddings": True})()})()


def test_specforge_config_carries_the_equal_settings(tmp_path):
    
    s = peers_train.equal_settings(_cfg(steps=40, warmup_steps=3, lr=0.002, precision="fp32",
                                        sequences_per_step=4, seed=7))
    prep = {"loaded": _Tied(tmp_path), "fuse_layers": [27, 2, 15]}
    cfg = specforge_config(s, prep, tmp_path / "data", tmp_path / "v.pt", tmp_path / "out",
                           target=tmp_path / "t", train_rows=50)
    m, t = cfg["model"], cfg["training"]
    assert m["aux_hidden_state_layer_ids"] == [1, 14, 26]  # SGLang's ids, in layer order
    assert m["lm_head_key"] == "model.embed_tokens.weight" and m["torch_dtype"] == "float32"
    assert m["target_model_path"] == str(tmp_path / "t")
    assert (t["max_steps"], t["total_steps"], t["batch_size"]) == (40, 40, 4)
    assert t["num_epochs"] * 50 >= 40 * 4  # enough rows for the steps
    assert (t["learning_rate"], t["max_grad_norm"], t["ttt_length"]) == (0.002, 1.0, 3)
    assert int(t["warmup_ratio"] * 40) == 3  # its scheduler's warm-up steps
    assert t["seed"] == 7 and t["attention_backend"] == "sdpa" and "kl_decay" not in t
    for bad, match in (({"weight_decay": 0.1}, "weight_decay"), ({"betas": "[0.9,0.95]"}, "betas"),
                       ({"decay": 0.5}, "decay=0.5")):
        with pytest.raises(ValueError, match=match):
            specforge_config(peers_train.equal_settings(_cfg(**bad)), prep, tmp_path, tmp_path,
                             tmp_path)


@pytest.mark.parametrize("steps", [4, 7, 40, 120, 1000, 4096])
def test_specforge_warmup_ratio_gives_the_warmup_steps(steps):
    from draftsmith.scripts.peers_specforge import warmup_ratio

    for w in range(steps):
        assert int(warmup_ratio(w, steps) * steps) == w, (w, steps)  # as its scheduler floors


def test_specforge_vocab_mapping_and_target_folder(tmp_path):
    from safetensors.torch import save_file

    from draftsmith.scripts.peers_specforge import specforge_target, vocab_mapping

    d2t = torch.tensor([0, 2, 3, 7])
    t2d = torch.zeros(10, dtype=torch.bool).index_fill_(0, d2t, True)
    got = vocab_mapping(d2t, t2d)
    assert got["d2t"].tolist() == [0, 1, 1, 4] and torch.equal(got["t2d"], t2d)  # offsets
    with pytest.raises(ValueError, match="ascending"):
        vocab_mapping(torch.tensor([0, 3, 2, 7]), t2d)
    with pytest.raises(ValueError, match="t2d"):
        vocab_mapping(d2t, t2d.roll(1))
    target = tmp_path / "target"
    target.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2), "model.norm.weight": torch.ones(2)},
              str(target / "model.safetensors"))
    (target / "config.json").write_text("{}")
    staged = specforge_target(target, tmp_path / "staged")
    index = __import__("json").loads((staged / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"model.embed_tokens.weight": "model.safetensors",
                                   "model.norm.weight": "model.safetensors"}
    assert (staged / "config.json").resolve() == (target / "config.json").resolve()
    assert specforge_target(staged, tmp_path / "again") == staged  # an index: used as it is


def test_specforge_loss_is_its_reference_with_its_kernels_gradient():
    """The runner's plain-torch loss: SpecForge's reference ``-sum(mask * p * log_softmax(x),
    2).mean()``, computed here position by position, and the gradient its Triton backward
    writes, ``(softmax(x) - p) * mask / (B * T)``."""
    from draftsmith.scripts.engine_runners.specforge_train import kl_loss

    g = torch.Generator().manual_seed(0)
    b, t, v = 2, 5, 7
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64).to(torch.bfloat16)
    logits.requires_grad_(True)
    p = torch.softmax(torch.randn(b, t, v, generator=g), -1)
    mask = (torch.rand(b, t, 1, generator=g) > 0.4).int()
    loss = kl_loss(logits, p, mask)
    expected = 0.0
    for i in range(b):
        for j in range(t):
            if mask[i, j, 0]:
                logq = logits[i, j].detach().float().log_softmax(-1)
                expected -= float((p[i, j] * logq).sum())
    assert loss.dtype == torch.float32
    assert float(loss.detach()) == pytest.approx(expected / (b * t), rel=1e-5)
    loss.backward()
    want = (logits.detach().float().softmax(-1) - p) * mask / (b * t)
    torch.testing.assert_close(logits.grad.float(), want, rtol=2e-2, atol=1e-4)
    # the twin: a mean over the counted positions only is another loss
    assert float(loss.detach()) != pytest.approx(expected / int(mask.sum()), rel=1e-3)


def test_modelopt_rows_and_job_carry_the_equal_settings(tmp_path):
    from conftest import tiny_llama

    from draftsmith.scripts.peers_modelopt import modelopt_job

    rows = _rows(2)
    assert peers_data.write_modelopt(tmp_path / "data", iter(rows)) == 2
    got = torch.load(tmp_path / "data" / "data_0.pt")
    assert torch.equal(got["loss_mask"][:-1], rows[0].loss_mask[1:].long())  # shifted as above
    assert torch.equal(got["aux_hidden_states"], rows[0].fused)

    class _Loaded:
        path = tmp_path
        model = tiny_llama(layers=4)

    s = peers_train.equal_settings(_cfg(steps=30, warmup_steps=3, lr=0.004))
    job = modelopt_job(s, {"loaded": _Loaded(), "fuse_layers": [1, 2, 3], "draft_vocab_size": 40},
                       tmp_path, tmp_path / "d2t.pt")
    arch, tc = job["eagle"]["eagle_architecture_config"], _Loaded.model.config
    assert arch["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # ModelOpt counts outputs
    assert (arch["num_attention_heads"], arch["num_key_value_heads"], arch["head_dim"],
            arch["intermediate_size"]) == (tc.num_attention_heads, tc.num_key_value_heads,
                                           tc.hidden_size // tc.num_attention_heads,
                                           tc.intermediate_size)  # not its Llama-3-8B default
    assert arch["rope_theta"] == tc.rope_parameters["rope_theta"] and arch["use_last_layernorm"]
    assert job["eagle"]["eagle_ttt_steps"] == 3 and job["eagle"]["eagle_loss_decay_factor"] == 0.8
    assert job["eagle"]["eagle_use_torch_compile"] is False
    t = job["training"]
    assert (t["max_steps"], t["warmup_steps"], t["learning_rate"]) == (30, 3, 0.004)
    assert t["per_device_train_batch_size"] == 4 and t["lr_scheduler_type"] == "cosine"
    assert (t["adam_beta1"], t["adam_beta2"], t["weight_decay"]) == (0.9, 0.999, 0.0)
    assert t["bf16"] is True and t["use_cpu"] is True and t["max_grad_norm"] == 1.0


@pytest.mark.slow
@pytest.mark.engines("speculators")
def test_speculators_own_trainer_writes_a_checkpoint_that_decodes_losslessly(decode_setup,
                                                                           tmp_path):
    """speculators' trainer itself (its environment, the CPU wrapper) on rows written by
    write_speculators for the tiny target; its checkpoint decodes through eval/decode.py with
    plain decoding's outputs."""
    import json
    import subprocess

    from draftsmith.eval import decode
    from draftsmith.heads.eagle import effective_norm_weight
    from draftsmith.scripts.engine_envs import engine_env, ensure_env

    loaded = decode_setup["loaded"]
    model, h = loaded.model, loaded.model.config.hidden_size
    g = torch.Generator().manual_seed(3)
    rows = []
    for n in (40, 33, 47, 29, 38, 44):
        ids = torch.randint(5, 96, (n,), generator=g)
        with torch.no_grad():
            hs = model(ids[None], output_hidden_states=True).hidden_states
        mask = torch.arange(n) >= n // 3
        rows.append(peers_data.Row(ids, mask, torch.cat([hs[0][0], hs[1][0]], -1), hs[2][0]))
    d2t = torch.arange(0, 96, 2)
    t2d = torch.zeros(96, dtype=torch.bool).index_fill_(0, d2t, True)
    data = peers_data.write_speculators(tmp_path / "sp", iter(rows[:5]), iter(rows[5:]),
                                        effective_norm_weight(model.model.norm, h), d2t, t2d)
    s = peers_train.equal_settings(_cfg(steps=4, warmup_steps=1, sequences_per_step=2,
                                        precision="fp32", threads=1))
    args = peers_train.speculators_args(s, data, decode_setup["target"], tmp_path / "ck", [0, 1])
    python = ensure_env("speculators", REPO / ".engines")
    runner = REPO / "scripts" / "engine_runners" / "speculators_train.py"
    done = subprocess.run([str(python), str(runner), str(tmp_path / "stats.json"), "1", "--",
                           *args], capture_output=True, text=True, timeout=900,
                          env=engine_env("speculators", python.parents[1]), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["steps"] == 4 and stats["trained_tokens"] > 0, stats
    ckpt = tmp_path / "ck" / str(stats["checkpoint_epoch"])
    config = json.loads((ckpt / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_fc"] is False
    run = decode.run_overrides([f"draft={ckpt}", f"target_path={decode_setup['target']}",
                                f"prompts={decode_setup['questions']}", "limit=2",
                                "max_new_tokens=12", "temperature=0", "k=3", "suffix=false"])
    assert run["summary"]["matches_baseline"] == 1.0 and run["summary"]["draft_kind"] == "eagle"


class _Packer:
    """A stand-in for speculators' packing sampler: rows in a seeded order, a batch closed when
    the next row would pass the budget (the interface the budget runner calls)."""

    def __init__(self, batch_max_length, lengths, num_replicas, rank, seed):
        self.budget, self.lengths, self.seed, self.epoch = batch_max_length, lengths, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(len(self.lengths),
                               generator=torch.Generator().manual_seed(self.seed + self.epoch))
        batches, cur, used = [], [], 0
        for i in order.tolist():
            if cur and used + self.lengths[i] > self.budget:
                batches.append(cur)
                cur, used = [], 0
            cur.append(i)
            used += self.lengths[i]
        return iter(batches + [cur])


def test_speculators_budget_counts_the_first_steps_batches_across_epochs():
    from draftsmith.scripts.engine_runners.speculators_budget import trained_tokens

    lengths, masked = [40, 40, 40, 40], [1, 2, 3, 4]
    # a budget of one row per batch: 6 steps are epoch 0 (all four rows) and two of epoch 1
    got = trained_tokens(_Packer, lengths, masked, 40, 6, seed=0)
    order1 = torch.randperm(4, generator=torch.Generator().manual_seed(1)).tolist()
    assert got == sum(masked) + masked[order1[0]] + masked[order1[1]]
    # the whole set in one batch: each step trains every row once
    assert trained_tokens(_Packer, lengths, masked, 160, 3, seed=0) == 3 * sum(masked)
    with pytest.raises(ValueError, match="packs no batch"):
        trained_tokens(lambda **kw: type("E", (), {"set_epoch": lambda s, e: None,
                                                   "__iter__": lambda s: iter([])})(),
                       lengths, masked, 40, 1, seed=0)
