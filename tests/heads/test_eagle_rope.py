"""The EAGLE head's RoPE outside training: tables kept between calls, one per dtype and device,
bounded by the positions asked for, with the values the rotary embedding computes directly."""
from __future__ import annotations

import torch

from draftsmith.heads.eagle import build_eagle
from draftsmith.heads.eagle_config import EagleConfig
from tests.conftest import tiny_llama


def test_rope_tables_stay_bounded_when_calls_switch_dtype():
    # Under autocast one validation step calls the head in fp32 and in bf16; a single table
    # rebuilt at every switch with doubled length had grown to tens of GB.
    head = build_eagle(EagleConfig(fuse_layers=[0, 1], layout="eagle3"), tiny_llama(seed=0))
    pos = torch.tensor([[0, 3, 7, 1500]])
    with torch.no_grad():
        for i in range(12):
            dtype = (torch.float32, torch.bfloat16)[i % 2]
            x = torch.zeros(1, 4, head.hidden_size, dtype=dtype)
            cos, sin = head._rope(x, pos, 1501)
            want_cos, want_sin = head.rotary_emb(x, pos)
            assert cos.dtype == dtype
            torch.testing.assert_close(cos, want_cos)
            torch.testing.assert_close(sin, want_sin)
    assert sorted(t[0].shape[0] for t in head._rope_tables.values()) == [1501, 1501]
