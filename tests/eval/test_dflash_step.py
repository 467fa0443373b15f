"""The DFlash proposer's preallocated context cache and block step
(``eval/decoding/dflash_step.py``) against a reference that recomputes the whole context's keys
and values from scratch every round with the drafter's modules (``context_kv`` +
``block_hidden``: what the old concatenating cache computed).

Tiny random drafters (2 layers; 4 query heads over 4, 2 or 1 key/value heads) are driven through
many rounds with accepts of 1 to B rows (the pending token and 0 to B-1 drafts), two requests
per proposer (the second reuses the buffers), with room reserved up front or grown from almost
nothing. Greedy drafts must be identical; sampled drafts identical and their q's equal within
fp32 tolerance (the fused matmuls and the kept RoPE table round differently from the modules:
the values are not bitwise equal). The twins, an append written one position past the
context's end and context keys rotated one position late, must change the drafts.
"""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama_config
from transformers import LlamaForCausalLM

from draftsmith.eval.decoding import dflash_step, kv_cache, proposers_dflash
from draftsmith.eval.decoding.dflash_step import DFlashStep
from draftsmith.eval.decoding.proposal import DecodeContext, Sampling
from draftsmith.eval.decoding.proposers_dflash import DFlashProposer
from draftsmith.eval.decoding.target_model import TargetOutput
from draftsmith.heads.dflash import DFlashDrafter
from draftsmith.heads.family import get_family

V, H, BLOCK, FUSE = 64, 32, 5, [1, 3]
ROUNDS = 14
GREEDY = Sampling()
SAMPLED = Sampling(temperature=0.8, top_k=40)


def _drafter(kv: int = 2, seed: int = 0) -> DFlashDrafter:
    """A 2-layer drafter of block 5 on a tiny Llama's config (4 query heads, ``kv`` key/value
    heads), every weight (embedding, norms and LM head included) moved by seeded noise."""
    tc = tiny_llama_config(vocab=V, hidden=H, layers=3, heads=4, kv=kv)
    cfg = get_family("dflash").head_config({"block_size": BLOCK, "fuse_layers": FUSE,
                                            "mask_token_id": 2, "num_layers": 2}, tc)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg, tc)
    drafter.attach_target(LlamaForCausalLM(tc))  # a random target's embedding and LM head
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return drafter.eval()


def _out(feats: torch.Tensor) -> TargetOutput:
    """A target output whose fused layers are ``feats (m, L*H)`` (logits and hidden unused)."""
    return TargetOutput(torch.empty(0), torch.empty(0), torch.stack(feats.split(H, dim=-1)))


@torch.no_grad()
def _reference_logits(drafter: DFlashDrafter, feats: torch.Tensor, anchor: int,
                      n: int) -> torch.Tensor:
    """Slots 1..n's logits with the context's keys and values recomputed from ``feats (T, .)``."""
    t = feats.shape[0]
    ctx_kv = drafter.context_kv(drafter.context(feats[None]), torch.arange(t)[None])
    hidden = drafter.block_hidden(drafter.block_ids(torch.tensor([[anchor]])),
                                  torch.arange(t, t + BLOCK)[None], ctx_kv)
    return drafter.compute_logits(hidden[0, 1:n + 1]).float()


def _drive(proposer: DFlashProposer, sampling: Sampling, seed: int,
           prompt_len: int) -> tuple[int, float]:
    """One request of ``ROUNDS`` rounds; returns (rounds whose drafts differ from the
    reference's, the largest |q - q_ref|)."""
    drafter, g = proposer.drafter, torch.Generator().manual_seed(seed)
    n_pos = prompt_len + ROUNDS * BLOCK
    feats = torch.randn(n_pos, len(FUSE) * H, generator=g)  # position t's fused target layers
    tokens = torch.randint(3, V, (n_pos + 1,), generator=g).tolist()
    n_ctx = prompt_len
    proposer.reset(tokens[:n_ctx + 1], _out(feats[:n_ctx]))
    differ, q_err = 0, 0.0
    for r in range(ROUNDS):
        k = (BLOCK - 1, 2, BLOCK + 3, 1)[r % 4]  # fewer slots than the block, all, and capped
        n = min(k, BLOCK - 1)
        ctx = DecodeContext(tokens[:n_ctx + 1], sampling, torch.Generator().manual_seed(r))
        got = proposer.propose(ctx, k)
        ref_logits = _reference_logits(drafter, feats[:n_ctx], tokens[n_ctx], n)
        if sampling.greedy:
            want = ref_logits.argmax(-1).tolist()
        else:
            ref_g = torch.Generator().manual_seed(r)
            draws = [sampling.sample_with_q(row, ref_g) for row in ref_logits]
            want = [x for x, _ in draws]
            q_ref = torch.stack([q for _, q in draws])
            q_err = max(q_err, float((got.q - q_ref).abs().max()))
        differ += got.tokens.tolist() != want
        m = 1 + int(torch.randint(0, n + 1, (1,), generator=g))  # pending + 0..n accepted drafts
        proposer.accept(list(range(m - 1)), tokens[n_ctx + 1:n_ctx + m + 1],
                        _out(feats[n_ctx:n_ctx + m]))
        n_ctx += m
        assert proposer.n_ctx == n_ctx
    return differ, q_err


@pytest.fixture(params=["reserved", "grown"])
def room(request, monkeypatch):
    """Room reserved up front (the default), or almost none: the slabs and the RoPE table grow
    (by doubling) many times during a request."""
    if request.param == "grown":
        monkeypatch.setattr(proposers_dflash, "RESERVE", 0)
        monkeypatch.setattr(kv_cache, "MIN_CAPACITY", 1)
        monkeypatch.setattr(dflash_step, "ROPE_TABLE_MIN", 1)
    return request.param


@pytest.mark.parametrize("kv", [4, 2, 1])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_drafts_equal_a_from_scratch_context_every_round(kv, sampling, room):
    proposer = DFlashProposer(_drafter(kv), V)
    for request, prompt_len in enumerate((7, 3)):  # the second request reuses the buffers
        differ, q_err = _drive(proposer, sampling, seed=request, prompt_len=prompt_len)
        assert differ == 0, f"{differ} of {ROUNDS} rounds drafted otherwise ({room})"
        assert q_err < 1e-5, q_err  # fp32; 0 when no op rounds differently


def test_appends_write_in_place_when_room_was_reserved():
    """A request within its reserved room never reallocates the buffers, and a second request
    reuses them: the cache's storage is the same throughout."""
    proposer = DFlashProposer(_drafter(), V)
    _drive(proposer, GREEDY, seed=0, prompt_len=7)
    ptrs = [layer.buf.data_ptr() for layer in proposer.drafting.cache.layers]
    assert len(ptrs) == 2
    _drive(proposer, GREEDY, seed=1, prompt_len=5)
    assert [layer.buf.data_ptr() for layer in proposer.drafting.cache.layers] == ptrs
    # the views handed to block_hidden are the committed context only, reading the buffers
    for keys, values in proposer.cache:
        assert keys.shape[2] == values.shape[2] == proposer.n_ctx
        assert keys.untyped_storage().data_ptr() in ptrs


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)],
                         ids=["fp32", "bf16"])
def test_the_block_step_equals_the_module_path_over_the_views(dtype, tol):
    """DFlashStep.block's final-norm states equal ``block_hidden`` over ``proposer.cache`` (up
    to rounding: a few bf16 ulps of states of norm ~1)."""
    proposer = DFlashProposer(_drafter(kv=1).to(dtype), V)
    _drive(proposer, GREEDY, seed=3, prompt_len=4)
    d, p = proposer.drafter, proposer.n_ctx
    with torch.inference_mode():
        fused = proposer.drafting.block(7)
        modules = d.block_hidden(d.block_ids(torch.tensor([[7]])),
                                 torch.arange(p, p + BLOCK)[None], proposer.cache)[0]
    assert fused.dtype == modules.dtype == dtype
    torch.testing.assert_close(fused, modules, rtol=tol, atol=tol)
    assert proposer.n_ctx == p and proposer.cache[0][0].shape[2] == p  # the block left nothing


class AppendOnePastTheEnd(DFlashStep):
    """Broken twin: every append after the first writes one position past the context's end
    (the stale row there, the previous block's anchor key, is read as context)."""

    def append(self, feats):
        for layer in self.cache.layers:
            layer.length += 1
        super().append(feats)


class ContextRopeOneLate(DFlashStep):
    """Broken twin: the context's keys are rotated one position later than they sit."""

    late = 0

    def append(self, feats):
        self.late = 1
        try:
            super().append(feats)
        finally:
            self.late = 0

    def _rope(self, x, start, n):
        return super()._rope(x, start + self.late, n)


@pytest.mark.parametrize("broken", [AppendOnePastTheEnd, ContextRopeOneLate])
def test_twin_an_off_by_one_changes_the_drafts(broken):
    proposer = DFlashProposer(_drafter(), V)
    proposer.drafting = broken(proposer.drafter)
    differ, _ = _drive(proposer, GREEDY, seed=0, prompt_len=7)
    assert differ > 0, f"{broken.__name__} drafted what the reference drafts"
    _, q_err = _drive(proposer, SAMPLED, seed=1, prompt_len=7)
    assert q_err > 0.1, f"{broken.__name__} drew from the reference's q's ({q_err:.2g})"
