"""The real Qwen2.5-Coder-0.5B-Instruct target (pkg:qwen2p5_coder_0p5b, installed by make
install; joined from its chunk packages and converted once, then read from the target cache):
its shape and chat format, and every stand-in proposer's greedy output equal to the target's
own in fp32 on a target with a 151,936-word vocabulary and 14 / 2 grouped-query heads."""
from __future__ import annotations

import pytest
from transformers import Qwen2ForCausalLM

from draftsmith.data.packaged import packaged_target
from draftsmith.data.target import load_target
from draftsmith.eval import exactness

pytestmark = [pytest.mark.real, pytest.mark.xdist_group("qwen_small")]


@pytest.fixture(scope="module")
def qwen_small():
    return load_target("pkg:qwen2p5_coder_0p5b")


def test_real_qwen_target_is_the_pinned_chat_model(qwen_small):
    ident = qwen_small.identity
    assert isinstance(qwen_small.model, Qwen2ForCausalLM)
    assert (ident.vocab_size, ident.hidden_size, ident.num_layers) == (151936, 896, 24)
    assert ident.weights_sha256 == packaged_target("qwen2p5_coder_0p5b").sha256
    assert qwen_small.chat_format == "tokenizer"  # its own ChatML template
    text = qwen_small.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                    add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_real_qwen_target_every_standin_proposer_is_exact(qwen_small, tmp_path):
    # plain decoding, prompt lookup, the suffix proposer, the EAGLE stand-in (untrained: every
    # draft rejected) and a draft LM holding all 24 target layers (every draft accepted), each as
    # a chain and a tree, on one HumanEval prompt: the rejection and the acceptance paths on a
    # Qwen2 target within a minute of the suite (each proposer pays its own prefill). Medusa's
    # stand-in heads would each hold a 151,936-row LM head and the hybrids double the time: both
    # left to the SmolLM2 check; more prompts: eval/exactness.py on the 1.5B (README).
    res = exactness.run_overrides(["prompts=[humaneval]", "per_set=1", "max_new_tokens=12",
                                   "drafts=[]", "k=3", "~standins.medusa",
                                   "standins.lm.num_layers=24", "tree_topk=3", "tree_size=8",
                                   "suffix=false", f"out={tmp_path / 'exactness.json'}"],
                                  qwen_small)
    assert set(res["proposers"]) == {"plain", "lookup", "suffix", "lm-chain@untrained",
                                     "lm-tree@untrained", "eagle-chain@untrained",
                                     "eagle-tree@untrained"}
    assert len(res["references"]) == 1
    for name, r in res["proposers"].items():
        assert r["total"] == 1, name
        assert (r["identical"], r["ties"], r["non_ties"]) == (1, 0, 0), (name, r["divergences"])
    for name in ("lm-chain@untrained", "lm-tree@untrained"):  # the target's own layers
        assert res["proposers"][name]["acceptance_rate"] == 1.0, name
        assert res["proposers"][name]["tau"] >= 2.5, name
