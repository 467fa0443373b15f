"""Decode prompts in llama.cpp (llama-cpp-python), plainly and with a GGUF draft model; run inside
the llama.cpp environment.

    <engines>/llama_cpp/bin/python scripts/engine_runners/llama_cpp_run.py JOB.json RESULT.json

JOB.json: ``target`` (the target's .gguf), ``prompts`` (lists of token ids), ``max_tokens``,
``temperature``, ``seed``, ``max_model_len`` and ``runs``: ``[{"name", "draft" (a .gguf or
null), "k"}, ...]``. llama-cpp-python speculates through its ``draft_model`` hook: after each
sampled token it asks the draft for tokens, evaluates them with the target in one batch and keeps
them while the target's own sample at each position equals the draft (greedy: lossless). The hook
here runs the draft GGUF greedily for k tokens (its KV cache reused across calls by prefix
match). The binding reports no acceptance counters, so each call's drafts are recorded and, after
the run, scored against the tokens the target produced: per draft position, drafts equal to the
output there with every earlier draft of the call equal too (calls whose k positions all lie
within the output). RESULT.json: per run the output token ids per prompt, tokens/s and those
counts, or the engine's error. This file imports only llama_cpp and numpy.
"""
from __future__ import annotations

import time

import numpy as np


def _draft_model(path: str, k: int, n_ctx: int, calls: list):
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaDraftModel

    class GreedyDraft(LlamaDraftModel):
        """k greedy tokens from a draft GGUF; every call recorded as (prefix length, drafts)."""

        def __init__(self) -> None:
            self.llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=2, verbose=False)

        def __call__(self, input_ids, /, **kwargs):
            out = []
            for tok in self.llm.generate(list(map(int, input_ids)), temp=0.0, top_k=1,
                                         reset=True):
                out.append(int(tok))
                if len(out) == k:
                    break
            calls.append((len(input_ids), out))
            return np.array(out, dtype=np.intc)

    return GreedyDraft()


def _score(calls: list, sequence: list[int], k: int) -> tuple[int, list[int]]:
    """(judged draft calls, accepted drafts per position) against the produced sequence."""
    steps, accepted = 0, [0] * k
    for start, drafts in calls:
        if start + k > len(sequence) or len(drafts) < k:
            continue
        steps += 1
        for j, tok in enumerate(drafts):
            if sequence[start + j] != tok:
                break
            accepted[j] += 1
    return steps, accepted


def run_one(job: dict, run: dict) -> dict:
    from llama_cpp import Llama

    k, n_ctx = int(run.get("k") or 0), int(job["max_model_len"])
    calls: list = []
    draft = _draft_model(run["draft"], k, n_ctx, calls) if run.get("draft") else None
    llm = Llama(model_path=job["target"], n_ctx=n_ctx, n_threads=2, seed=int(job["seed"]),
                draft_model=draft, verbose=False)
    eos = llm.token_eos()
    temp = float(job["temperature"])

    def generate(ids: list[int]) -> list[int]:
        out: list[int] = []
        for tok in llm.generate(ids, temp=temp, top_k=1 if temp == 0 else 0, top_p=1.0,
                                min_p=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if tok == eos or len(out) == int(job["max_tokens"]):
                break
        return out

    generate(job["prompts"][0])  # warm-up
    outputs, seconds, steps, accepted = [], 0.0, 0, [0] * k
    for ids in job["prompts"]:
        calls.clear()
        t0 = time.perf_counter()
        out = generate(list(ids))
        seconds += time.perf_counter() - t0
        outputs.append(out)
        if draft is not None:
            s, a = _score(calls, list(ids) + out, k)
            steps, accepted = steps + s, [x + y for x, y in zip(accepted, a)]
    tokens = sum(len(o) for o in outputs)
    spec = {"draft_calls": steps, "accepted_per_position": accepted} if draft else {}
    return {"name": run["name"], "ok": True, "outputs": outputs, "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds else None, "spec": spec}


if __name__ == "__main__":
    from runner import main

    main("llama_cpp", "llama-cpp-python", run_one)
