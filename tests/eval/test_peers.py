"""eval/peers.py: the transformers peers' generate arguments, the assistant's settings, which
packages can assist, and greedy runs on the tiny target of tests/conftest.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import draft_package, tiny_llama
from transformers import PreTrainedModel

from draftsmith.data.identity import TargetMismatchError
from draftsmith.eval.peers import (
    PEER_METHODS,
    assistant_settings,
    generation_kwargs,
    load_assistant,
    run_peer_on,
)
from draftsmith.eval.session import prompt_records
from draftsmith.heads.package import load_package, save_package

CPU = torch.device("cpu")


def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def lively():
    """A tiny target whose greedy outputs vary (the default tiny Llama repeats its last input
    token); same vocabulary and special ids as the decode_setup target."""
    return tiny_llama(seed=3, initializer_range=0.5)


@pytest.fixture(scope="module")
def prompts(decode_setup):
    return prompt_records(decode_setup["questions"], decode_setup["loaded"].tokenizer, limit=2)


# ----- generate's arguments ----------------------------------------------------------------------
def test_greedy_generation_kwargs_turn_sampling_off():
    kw = generation_kwargs("hf_generate", 0.0, 12, None, None, top_k=5, top_p=0.9,
                           pad_token_id=0)
    assert kw == {"max_new_tokens": 12, "pad_token_id": 0, "do_sample": False,
                  "temperature": None, "top_k": None, "top_p": None}


def test_sampling_generation_kwargs_carry_the_warping():
    kw = generation_kwargs("hf_generate", 0.7, 12, None, None)
    assert kw == {"max_new_tokens": 12, "pad_token_id": None, "do_sample": True,
                  "temperature": 0.7, "top_k": 0, "top_p": 1.0}  # 0 / 1.0: no warping
    kw = generation_kwargs("hf_assisted", 1.0, 4, 3, "constant", top_k=5, top_p=0.9)
    assert (kw["do_sample"], kw["top_k"], kw["top_p"]) == (True, 5, 0.9)
    assert "prompt_lookup_num_tokens" not in kw  # the assistant's K is set on the assistant
    assert not any(k.startswith(("num_assistant", "assistant")) for k in kw)


def test_prompt_lookup_passes_k_to_generate():
    kw = generation_kwargs("hf_prompt_lookup", 0.0, 8, 3, None)
    assert kw["prompt_lookup_num_tokens"] == 3 and kw["do_sample"] is False
    assert "prompt_lookup_num_tokens" not in generation_kwargs("hf_generate", 0.0, 8, 3, None)


def test_generation_kwargs_refuse_an_unknown_method_and_a_missing_k():
    with pytest.raises(ValueError, match=r"method='spec' is not a transformers peer") as e:
        generation_kwargs("spec", 0.0, 8, 3, None)
    assert all(m in str(e.value) for m in PEER_METHODS)
    for method in ("hf_assisted", "hf_prompt_lookup"):
        for k in (None, 0):
            with pytest.raises(ValueError, match=rf"method={method} needs k= .*got {k!r}"):
                generation_kwargs(method, 0.0, 8, k, None)
    generation_kwargs("hf_generate", 0.0, 8, None, None)  # plain generate needs no k


def test_assistant_settings_constant_fixes_k_and_heuristic_keeps_the_defaults():
    constant = {"num_assistant_tokens": 3, "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0}
    assert assistant_settings(3, "constant") == constant
    assert assistant_settings(3, None) == constant  # the default schedule
    assert assistant_settings(5, "heuristic") == {"num_assistant_tokens": 5,
                                                  "num_assistant_tokens_schedule": "heuristic"}
    with pytest.raises(ValueError, match=r"schedule='linear': use constant or heuristic"):
        assistant_settings(3, "linear")


# ----- which packages can assist ----------------------------------------------------------------
def test_load_assistant_returns_the_draft_lm_in_the_asked_dtype(decode_setup):
    lm = load_assistant(decode_setup["lm"], decode_setup["loaded"], torch.bfloat16, CPU)
    assert isinstance(lm, PreTrainedModel) and not lm.training
    assert {p.dtype for p in lm.parameters()} == {torch.bfloat16}
    want = load_package(decode_setup["lm"]).module.state_dict()
    got = lm.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)


def test_load_assistant_refuses_a_medusa_package(decode_setup):
    pkg, _ = draft_package(decode_setup, "medusa")
    with pytest.raises(ValueError, match=r"needs a draft LM package, .* is draft_kind='medusa'"):
        load_assistant(pkg, decode_setup["loaded"], torch.float32, CPU)


def test_load_assistant_refuses_a_package_for_another_target(decode_setup, tmp_path):
    src = load_package(decode_setup["lm"])
    other = dataclasses.replace(src.identity, weights_sha256="another-target")
    pkg = save_package(tmp_path / "other", "lm", src.module, src.head_config, other,
                       tokenizer=decode_setup["loaded"].tokenizer)
    with pytest.raises(TargetMismatchError, match="weights_sha256"):
        load_assistant(pkg, decode_setup["loaded"], torch.float32, CPU)


# ----- runs on the tiny target ------------------------------------------------------------------
def test_greedy_hf_generate_equals_model_generate(decode_setup, lively, prompts):
    model, tok = lively, decode_setup["loaded"].tokenizer
    out = run_peer_on(model, prompts, "hf_generate", max_new_tokens=8, tokenizer=tok)
    samples, summary = out["samples"], out["summary"]
    assert len(samples) == 2
    for s, p in zip(samples, prompts):
        assert s["id"] == p["id"] and s["prompt_ids"] == p["prompt_ids"]
        assert s["output_ids"] == _hf_greedy(model, p["prompt_ids"], 8)
        assert s["output_text"] == tok.decode(s["output_ids"], skip_special_tokens=True)
        assert s["target_forwards"] == len(s["output_ids"])  # one forward per new token
    assert samples[0]["output_ids"] != samples[1]["output_ids"]
    tokens = sum(len(s["output_ids"]) for s in samples)
    assert summary["tokens_generated"] == tokens == summary["target_forwards"]
    assert summary["tau"] == 1.0 and summary["speedup"] == 1.0
    assert summary["baseline_tokens_per_s"] == summary["tokens_per_s"] > 0
    assert (summary["draft_kind"], summary["device"], summary["dtype"]) == (
        "hf_generate", "cpu", "float32")


def test_greedy_assisted_generation_equals_plain_generate(decode_setup, lively, prompts):
    model = lively
    assistant = load_assistant(decode_setup["lm"], decode_setup["loaded"], torch.float32, CPU)
    out = run_peer_on(model, prompts, "hf_assisted", max_new_tokens=8, k=3,
                      schedule="constant", assistant=assistant)
    for s, p in zip(out["samples"], prompts):
        assert s["output_ids"] == _hf_greedy(model, p["prompt_ids"], 8)  # lossless
        assert s["target_forwards"] <= len(s["output_ids"])
    cfg = assistant.generation_config  # where transformers reads the assistant's K
    assert (cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule,
            cfg.assistant_confidence_threshold) == (3, "constant", 0.0)
    summary = out["summary"]
    assert summary["k"] == 3 and summary["schedule"] == "constant"
    assert summary["speedup"] > 0 and summary["baseline_tokens_per_s"] > 0


def test_run_peer_on_refuses_no_prompts_and_assisted_without_a_draft(decode_setup, prompts):
    model = decode_setup["loaded"].model
    with pytest.raises(ValueError, match="no prompts to decode"):
        run_peer_on(model, [], "hf_generate")
    with pytest.raises(ValueError, match="method=hf_assisted needs a draft LM"):
        run_peer_on(model, prompts, "hf_assisted", k=3)
