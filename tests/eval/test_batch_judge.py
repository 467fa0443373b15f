"""The batch's own fallback (eval/decoding/batch_judge.py): rounds whose rows commit fewer tokens
per second than the batch's plain steps turn the whole batch to plain steps, decided on a
measured plain step (a judge that lets the rows' fastest verification stand in for it, as each
row's controller does, keeps a losing batch speculating); a paying batch keeps speculating with a
measured plain step now and then; batched chains and trees fall back and stay lossless."""
from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from draftsmith.eval.decoding.batch import BatchDecoder
from draftsmith.eval.decoding.batch_judge import PLAIN_EVERY, BatchJudge
from draftsmith.eval.decoding.proposers_eagle import EagleProposer
from draftsmith.scripts.bench_mixed import Hostile
from tests.conftest import tiny_llama
from tests.eval.test_batch import BATCH_PROMPTS, make
from tests.eval.test_decoder import VOCAB, hf_greedy

PLAIN_S = 0.01  # a plain step of the batch


def _run(judge: BatchJudge, rounds: int, committed: list[int], t_draft: float,
         t_verify: float) -> list[bool]:
    """``rounds`` rounds of a batch whose speculative rounds commit ``committed`` tokens per row
    in ``t_draft + t_verify`` seconds; its plain steps take :data:`PLAIN_S`. Whether each
    drafted."""
    drafted = []
    for _ in range(rounds):
        spec = judge.speculates()
        drafted.append(spec)
        if spec:
            judge.record([3] * len(committed), [3] * len(committed), committed, t_draft, t_verify)
        else:
            judge.record([0] * len(committed), [0] * len(committed), [1] * len(committed), 0.0,
                         PLAIN_S)
    return drafted


class _Unmeasured(BatchJudge):
    """The twin: no plain step of its own; the fastest verification stands in for it."""

    def speculates(self) -> bool:
        return self.ctrl.next_k() > 0


# a losing batch: one row accepts its drafts, two do not (1.67 tokens a round on average), and a
# round costs 4 plain steps (the block of 3 rows x 4 tokens costs 3 plain steps, drafting one)
LOSING = ([3, 1, 1], 0.01, 0.03)


def test_a_losing_batch_takes_plain_steps_and_probes():
    judge = BatchJudge(k=3)
    drafted = _run(judge, 60, *LOSING)
    # two rounds, a measured plain step, the first decision after the third: a plain stretch
    assert drafted[:4] == [True, True, False, True]
    assert not any(drafted[4:4 + judge.ctrl.probe_every])
    assert drafted[4 + judge.ctrl.probe_every]  # the probe
    assert judge.plain_rounds == drafted.count(False)


def test_twin_without_a_measured_plain_step_keeps_a_losing_batch_speculating():
    twin = _Unmeasured(k=3)
    assert all(_run(twin, 60, *LOSING))  # 4 / 3 plain steps a round seen: below 1.67 tokens


def test_a_paying_batch_keeps_speculating_with_a_plain_step_now_and_then():
    judge = BatchJudge(k=3)
    drafted = _run(judge, 200, [3, 3, 2], 0.004, 0.011)  # 2.67 tokens for 1.5 plain steps
    plain = [i for i, d in enumerate(drafted) if not d]
    assert plain[0] == 2 and all(b - a == PLAIN_EVERY + 1 for a, b in pairwise(plain))
    assert len(plain) == 1 + (200 - 3) // (PLAIN_EVERY + 1)


@pytest.fixture(scope="module")
def target_model():
    return tiny_llama(seed=0, vocab=VOCAB)


def _useless(name: str, model):
    if name == "lm-chain":  # a draft LM the size of the target, every row's drafts shifted
        return make("lm", model), 3
    torch.manual_seed(4)  # an untrained EAGLE head drafting trees
    from draftsmith.heads.eagle import build_eagle
    from draftsmith.heads.eagle_config import EagleConfig

    head = build_eagle(EagleConfig(), model).eval()
    return EagleProposer(head, VOCAB, tree=True, topk=2, total_tokens=6), 3


@pytest.mark.parametrize("name", ["lm-chain", "eagle-tree"])
def test_batched_drafts_that_lose_fall_back_for_the_batch_and_stay_exact(target_model, name):
    proposer, k = _useless(name, target_model)
    dec = BatchDecoder(target_model, proposer, k=k, fallback=True)
    if name == "lm-chain":
        dec.drafter = Hostile(dec.drafter, [0, 1, 2], VOCAB)
    prompts = BATCH_PROMPTS[:3]
    got = dec.generate(prompts, max_new_tokens=40)
    for prompt, res in zip(prompts, got):
        assert res.output_ids == hf_greedy(target_model, prompt, 40, None)
    assert dec.judge is not None and dec.judge.plain_rounds > 20
    assert all(r.stats.plain_steps > 2 * r.stats.spec_steps for r in got)
    # without fallback the same batch drafts every round (but a last one with no budget left)
    off = BatchDecoder(target_model, proposer, k=k, fallback=False)
    assert off.generate(prompts, max_new_tokens=40)[0].stats.plain_steps <= 1
