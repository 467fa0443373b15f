"""The distillation recipe with a DFlash drafter, end to end in process, on a tiny random target
saved with the character tokenizer (no download, no packaged model): the feature cache holds
the fused layers ``fuse_layers: auto`` resolves to, the loss falls, alpha-hat rises for every
block slot, and the package loads with the resolved head config. The default mask id (the
target's pad id) is refused first: this random target's padding row is all zeros."""
from __future__ import annotations

import json

import pytest
from conftest import make_char_tokenizer, tiny_llama

from tests.train.launching import run_inprocess


def test_dflash_trains_through_the_recipe(tmp_path):
    target = tmp_path / "target"
    tiny_llama(seed=0, layers=4, hidden=64, initializer_range=0.3).save_pretrained(target)
    make_char_tokenizer().save_pretrained(target)
    common = ["debug=tiny", "data=sharegpt_tiny", "data.max_length=512", "logging=none",
              "target.tiny=null", f"target.path={target}", f"data.cache.dir={tmp_path / 'cache'}",
              "draft=dflash"]
    with pytest.raises(ValueError, match="mask_token_id=0 has an all-zero embedding row"):
        run_inprocess(common + ["train.max_steps=1", f"out_dir={tmp_path / 'refused'}"])
    out = tmp_path / "run"
    summary = run_inprocess(common + ["draft.config.mask_token_id=2", "draft.config.block_size=4",
                                      "draft.num_positions=3", "train.max_steps=30",
                                      "train.eval_every=30", "train.save_every=30",
                                      "optim.lr=3e-3", f"out_dir={out}"])
    losses = [r["loss"] for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines())
              if "loss" in r]
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), losses
    init, final = summary["alpha_hat_init"], summary["alpha_hat"]
    assert len(final) == 3 and all(f > i + 0.05 for i, f in zip(init, final)), (init, final)
    from draftsmith.heads.package import load_package

    pkg = load_package(out / "draft")
    assert pkg.family.name == "dflash" and pkg.head_config.fuse_layers == [1, 2, 3]
    assert (pkg.head_config.mask_token_id, pkg.head_config.block_size) == (2, 4)
    manifest = json.loads(next((tmp_path / "cache").rglob("manifest.json")).read_text())
    assert manifest["layers"] == [1, 2, 3]  # the feature cache holds the fused layers
