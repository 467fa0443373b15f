"""The CUDA paths: speculative decoding of a tiny target on the GPU, sampling there, dtype=auto
on a GPU and one bf16 training step of the tiny recipe. Skipped without CUDA (``-m gpu`` selects
them on a GPU machine)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import QUESTIONS, make_char_tokenizer, randomize, tiny_llama

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parents[2]
CUDA = "cuda"
TINY = ["debug=tiny", "data=sharegpt_tiny", "data.num_conversations=24", "data.max_length=96",
        "logging=none"]  # as tests/train/test_distill.py


@pytest.fixture(scope="module")
def on_cuda():
    """A tiny target whose greedy outputs vary, a draft LM that agrees with it now and then (both
    on the GPU) and two chat prompts."""
    from draftsmith.eval.session import encode_prompt
    from draftsmith.heads.draft_lm import DraftLMConfig, build_draft_lm

    model = tiny_llama(seed=3, initializer_range=0.5)
    draft = randomize(build_draft_lm(DraftLMConfig.matching(model.config, 2, init="target"),
                                     model), seed=2)
    tok = make_char_tokenizer()
    records = [{"id": str(q["question_id"]), "category": q["category"],
                "prompt_ids": encode_prompt(tok, q["turns"][0])} for q in QUESTIONS[:2]]
    return model.to(CUDA).eval(), draft.to(CUDA).eval(), records


def _proposer(draft, model, tree: bool):
    from draftsmith.eval.decoding.proposers import DraftLMProposer

    return DraftLMProposer(draft, model.config.vocab_size, tree=tree, topk=3, total_tokens=8)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_greedy_speculative_decoding_on_cuda_equals_plain_decoding(on_cuda, tree):
    from draftsmith.eval.session import Sampling, decoder, eos_ids, paired

    model, draft, records = on_cuda
    dec = decoder(model, _proposer(draft, model, tree), records, k=3, adaptive=False,
                  fallback=False)
    res = paired(dec, model, records, Sampling(max_new_tokens=12), eos_ids(model))
    assert res.matches_baseline == 1.0
    assert res.stats.drafted > 0
    for s, r in zip(res.samples, records):  # and both equal transformers' greedy generate
        ids = torch.tensor([r["prompt_ids"]], device=CUDA)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                             do_sample=False, pad_token_id=0)
        assert s["output_ids"] == out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("drafter", ["plain", "lm", "lm-tree"])
def test_sampling_at_temperature_one_runs_on_cuda(on_cuda, drafter):
    """The decoder's random generator must live where the target's logits are: a CPU
    ``torch.Generator`` cannot drive ``torch.multinomial`` / ``torch.rand`` on CUDA tensors."""
    from draftsmith.eval.decoding.proposers import PlainProposer
    from draftsmith.eval.session import decoder

    model, draft, records = on_cuda
    proposer = (PlainProposer() if drafter == "plain"
                else _proposer(draft, model, tree=drafter == "lm-tree"))
    dec = decoder(model, proposer, k=0 if drafter == "plain" else 3)
    prompt = records[0]["prompt_ids"]
    a = dec.generate(prompt, 12, temperature=1.0, seed=5)
    b = dec.generate(prompt, 12, temperature=1.0, seed=5)
    assert 1 <= len(a.output_ids) <= 12
    assert all(0 <= t < model.config.vocab_size for t in a.output_ids)
    assert a.output_ids == b.output_ids  # seeded: reproducible on the GPU too


def test_auto_dtype_on_cuda_is_a_supported_dtype():
    from draftsmith.data.dtype import CANDIDATES, matmul_rates, resolve_dtype

    name = resolve_dtype("auto", CUDA)
    assert name in CANDIDATES
    torch.zeros(2, device=CUDA, dtype=getattr(torch, name))  # usable there
    rates = matmul_rates(CUDA)
    assert set(rates) == set(CANDIDATES) and all(r > 0 for r in rates.values())


def test_one_bf16_training_step_of_the_tiny_recipe_on_cuda(tmp_path):
    from accelerate.state import AcceleratorState
    from hydra import compose, initialize_config_dir

    from draftsmith.train.distill import DistillRecipe

    overrides = TINY + ["draft=medusa", "train.max_steps=1", "train.eval_every=1",
                        "train.save_every=1", "train.mixed_precision=bf16", f"out_dir={tmp_path}"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="distill", overrides=overrides)
    AcceleratorState._reset_state(True)
    recipe = DistillRecipe(cfg)
    try:
        recipe.setup()
        assert recipe.accelerator.device.type == "cuda"
        assert recipe.accelerator.mixed_precision == "bf16"
        params = {n: p for n, p in recipe.draft.module.named_parameters() if p.requires_grad}
        assert params and all(p.device.type == "cuda" for p in params.values())
        before = {n: p.detach().clone() for n, p in params.items()}
        final = recipe.train()
    finally:
        recipe.cleanup()
        AcceleratorState._reset_state(True)
    assert recipe.step == 1
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 1 and math.isfinite(losses[0]) and losses[0] > 0
    assert any(not torch.equal(before[n], p.detach()) for n, p in params.items())  # it stepped
    assert all(0.0 <= a <= 1.0 for a in final["alpha_hat"])
