"""Decode prompts in llama.cpp (llama-cpp-python), plainly and with a GGUF draft model; run inside
the llama.cpp environment.

    <engines>/llama_cpp/bin/python scripts/engine_runners/llama_cpp_run.py JOB.json RESULT.json

JOB.json: ``target`` (the target's .gguf), ``prompts`` (lists of token ids), ``max_tokens``,
``temperature``, ``seed``, ``max_model_len`` and ``runs``: ``[{"name", "draft" (a .gguf), "k",
"sweep" (other draft lengths), "sweep_prompts"}, ...]``. A plain ``Llama`` of the target, made
once, and the run's speculative one live in this process; after a warm-up of each, every
prompt is decoded plainly, speculatively and plainly again (the sweep: a speculative ``Llama``
per other k on the first ``sweep_prompts`` prompts).

llama-cpp-python speculates through its ``draft_model`` hook: after each sampled token it asks
the draft for tokens, evaluates them with the target in one batch and keeps them while the
target's own sample at each position equals the draft (greedy: lossless). The hook here runs
the draft GGUF greedily for k tokens (its KV cache reused across calls by prefix match). The
binding reports no acceptance counters, so each call's drafts are recorded and, after
the run, scored against the tokens the target produced: per draft position, drafts equal to the
output there with every earlier draft of the call equal too (calls whose k positions all lie
within the output). RESULT.json: per run the output token ids per prompt (speculative; both
plain runs), each prompt's wall times and token counts, those counts and the sweep's, or the
engine's error. This file imports only llama_cpp and numpy.
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


def _generate(llm, ids: list[int], job: dict) -> tuple[list[int], float]:
    eos, temp = llm.token_eos(), float(job["temperature"])
    out: list[int] = []
    t0 = time.perf_counter()
    for tok in llm.generate(list(map(int, ids)), temp=temp, top_k=1 if temp == 0 else 0,
                            top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if tok == eos or len(out) == int(job["max_tokens"]):
            break
    return out, time.perf_counter() - t0


_PLAIN: dict = {}  # target -> its plain Llama, made once per process


def _llama(job: dict, draft=None):
    from llama_cpp import Llama

    return Llama(model_path=job["target"], n_ctx=int(job["max_model_len"]), n_threads=2,
                 seed=int(job["seed"]), draft_model=draft, verbose=False)


def _paired(plain, spec, calls: list, k: int, prompts: list, job: dict) -> dict:
    """Per prompt: plain, speculative, plain again (after a warm-up of each)."""
    for llm in (plain, spec):
        _generate(llm, prompts[0], job)
    rows, outputs, plain_outputs, steps, accepted = [], [], [], 0, [0] * k
    for ids in prompts:
        a, ta = _generate(plain, ids, job)
        calls.clear()
        s, ts = _generate(spec, ids, job)
        n, acc = _score(calls, list(ids) + s, k)
        steps, accepted = steps + n, [x + y for x, y in zip(accepted, acc)]
        b, tb = _generate(plain, ids, job)
        rows.append({"plain_s": [ta, tb], "plain_tokens": [len(a), len(b)], "spec_s": ts,
                     "spec_tokens": len(s)})
        outputs.append(s)
        plain_outputs.append([a, b])
    return {"prompts": rows, "outputs": outputs, "plain_outputs": plain_outputs,
            "spec": {"draft_calls": steps, "accepted_per_position": accepted}}


def run_one(job: dict, run: dict) -> dict:
    if job["target"] not in _PLAIN:
        _PLAIN[job["target"]] = _llama(job)
    plain = _PLAIN[job["target"]]

    def paired(k: int, prompts: list) -> dict:
        calls: list = []
        spec = _llama(job, _draft_model(run["draft"], k, int(job["max_model_len"]), calls))
        return _paired(plain, spec, calls, k, prompts, job)

    main = paired(int(run["k"]), job["prompts"])
    few = job["prompts"][:int(run.get("sweep_prompts") or len(job["prompts"]))]
    sweep = [{"k": int(k), **{key: v for key, v in paired(int(k), few).items()
                              if key in ("prompts", "spec")}} for k in run.get("sweep") or []]
    return {"name": run["name"], "ok": True, **main, "sweep": sweep}


if __name__ == "__main__":
    from runner import main

    main("llama_cpp", "llama-cpp-python", run_one)
