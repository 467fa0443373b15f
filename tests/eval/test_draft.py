"""eval/draft.py: how speculation.json and the decode options settle into DraftSettings."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from draftsmith.eval import draft
from draftsmith.eval.draft import (
    DEFAULT_K,
    DEFAULT_TREE_SIZE,
    Measured,
    TreeMode,
    resolve_k,
    settle,
)
from draftsmith.heads.family import FAMILIES, get_family
from draftsmith.heads.family_base import TreeKind
from draftsmith.heads.medusa import DEFAULT_BRANCHING

OPTIONS = {"k": None, "tree": "auto", "tree_size": None, "tree_topk": 8,
           "medusa_branching": None, "draft_vocab": None, "dtype": "bfloat16", "device": "cpu"}


def _pkg(kind: str, spec: dict | None, path: Path | None = None) -> SimpleNamespace:
    return SimpleNamespace(family=get_family(kind), speculation=spec,
                           path=path or Path("/nonexistent"), head_config=None)


def _plan(kind: str, spec: dict | None, **options):
    return settle({**OPTIONS, **options}, _pkg(kind, spec))


def test_lm_tree_is_the_default_only_where_it_beat_the_chain():
    spec = {"k_star": 1, "dtype": "bfloat16", "hardware": {"device": "cpu"},
            "measured_speedup": {"speedup": 1.05},
            "tree": {"depth": 2, "total_tokens": 8, "speedup": 1.2}}
    plan = _plan("lm", spec)
    assert (plan.tree, plan.k, plan.tree_size, plan.k_source) == (
        True, 2, 8, "speculation.json (tree)")
    assert _plan("lm", spec, dtype="float32").tree  # the nearest record (bf16's) says tree
    assert not _plan("lm", {**spec, "hardware": {"device": "cuda"}}, dtype="float32").tree
    assert not _plan("lm", {**spec, "tree": {**spec["tree"], "speedup": 1.0}}).tree
    assert not _plan("lm", {**spec, "tree": None}).tree
    assert _plan("lm", {**spec, "measured_speedup": {"k": 0, "speedup": None}}).tree
    assert not _plan("lm", None).tree  # nothing measured: the draft LM's default is the chain


def test_eagle_tree_gives_way_to_the_chain_only_where_the_chain_measured_faster():
    spec = {"k_star": 2, "dtype": "bfloat16", "hardware": {"device": "cpu"},
            "measured_speedup": {"speedup": 1.48},
            "tree": {"depth": 2, "total_tokens": 16, "speedup": 1.27}}
    plan = _plan("eagle", spec)
    assert (plan.tree, plan.k, plan.k_source) == (False, 2, "speculation.json")
    assert not _plan("eagle", spec, dtype="float32").tree  # the nearest record: bf16's chain
    assert _plan("eagle", {**spec, "tree": {**spec["tree"], "speedup": 1.6}}).tree
    assert _plan("eagle", {**spec, "measured_speedup": None}).tree
    assert not _plan("eagle", None).tree  # nothing measured: a short chain, not a large tree
    assert _plan("eagle", None, tree="tree").tree_size == DEFAULT_TREE_SIZE == 16
    assert not _plan("eagle", spec, tree="chain").tree and _plan("eagle", spec, tree="tree").tree


def test_the_tree_shape_is_measured_only_where_it_was_measured():
    spec = {"k_star": 1, "dtype": "bfloat16", "hardware": {"device": "cpu"},
            "tree": {"depth": 2, "total_tokens": 16}}
    plan = _plan("eagle", spec)
    assert (plan.k, plan.tree_size, plan.k_source) == (2, 16, "speculation.json (tree)")
    plan = _plan("eagle", spec, k=3)
    assert (plan.k, plan.tree_size, plan.k_source) == (3, 16, "config")
    plan = _plan("eagle", spec, dtype="float32")  # the nearest record: bfloat16's tree
    assert (plan.k, plan.tree_size) == (2, 16)
    assert plan.k_source == "speculation.json (bfloat16's record: nearest measured, tree)"
    plan = _plan("eagle", {**spec, "hardware": {"device": "cuda"}}, dtype="float32")
    assert (plan.tree, plan.k, plan.k_source) == (
        False, DEFAULT_K, "default (K* in speculation.json is for bfloat16)")  # not near
    plan = _plan("eagle", {**spec, "tree": None}, tree_size=8)
    assert (plan.k, plan.tree_size, plan.k_source) == (1, 8, "speculation.json")


def test_medusa_branching_is_measured_unless_given_and_kstar_zero_with_a_losing_tree_is_plain():
    spec = {"k_star": 2, "dtype": "bfloat16", "hardware": {"device": "cpu"},
            "measured_speedup": {"speedup": 3.0},  # a static tree is not compared with chains
            "tree": {"depth": 2, "total_tokens": 6, "branching": [3, 1], "speedup": 1.1}}
    plan = _plan("medusa", spec)
    assert (plan.tree, plan.options["medusa_branching"], plan.k, plan.k_source) == (
        True, (3, 1), 2, "speculation.json (tree)")
    plan = _plan("medusa", spec, medusa_branching=[2, 2, 1])
    assert (plan.options["medusa_branching"], plan.k, plan.k_source) == (
        (2, 2, 1), 2, "speculation.json")
    plan = _plan("medusa", {**spec, "k_star": 0, "tree": {**spec["tree"], "speedup": 0.9}})
    assert (plan.k, plan.k_source) == (0, "speculation.json (K* = 0, best tree 0.90x)")
    assert _plan("medusa", None).options["medusa_branching"] == DEFAULT_BRANCHING


def test_resolve_k_uses_k_star_only_for_the_dtype_and_device_it_was_measured_on():
    spec = {"k_star": 3, "dtype": "float32", "hardware": {"device": "cpu"}}
    assert resolve_k(None, spec, "float32", "cpu") == (3, "speculation.json")
    assert resolve_k(None, spec, "float32", "cuda:0")[1] == \
        "default (K* in speculation.json is for cpu)"
    assert resolve_k(None, spec, "bfloat16", "cpu")[0] == DEFAULT_K
    assert resolve_k(2, spec, "bfloat16", "cpu") == (2, "config")
    assert resolve_k(None, None) == (DEFAULT_K, "default")
    assert Measured.of({**spec, "k_star": True})[0] is None  # a bool is not a K*


def test_measured_draft_vocab_needs_the_counts_beside_it(tmp_path):
    spec = {"k_star": 1, "dtype": "bfloat16", "hardware": {"device": "cpu"},
            "draft_vocab": {"size": 20}}
    assert settle(OPTIONS, _pkg("lm", spec, tmp_path)).draft_vocab is None  # no counts file
    (tmp_path / "token_frequency.json").write_text("{}")
    assert settle(OPTIONS, _pkg("lm", spec, tmp_path)).draft_vocab == 20
    assert settle({**OPTIONS, "draft_vocab": "full"}, _pkg("lm", spec, tmp_path)).draft_vocab \
        is None
    assert settle(OPTIONS, _pkg("medusa", spec, tmp_path)).draft_vocab is None
    with pytest.raises(ValueError, match=r"applies to \('lm', 'eagle'\) drafts, not medusa"):
        settle({**OPTIONS, "draft_vocab": 40}, _pkg("medusa", spec, tmp_path))


def test_tree_modes_are_typed():
    assert TreeMode.parse("chain") is TreeMode.CHAIN
    with pytest.raises(ValueError, match="tree='bush': allowed auto, chain, tree"):
        TreeMode.parse("bush")


def test_every_family_names_a_proposer_that_builds_from_settings():
    for family in FAMILIES.values():
        cls = draft.proposer_class(family)
        assert callable(cls.for_draft), family.name
        assert family.tree in TreeKind


def test_a_text_only_proposer_refuses_a_trained_module_by_name():
    from draftsmith.eval.decoding.proposers import PlainProposer, PromptLookupProposer

    for cls in (PlainProposer, PromptLookupProposer):
        with pytest.raises(TypeError, match=f"{cls.__name__} drafts with no trained module"):
            cls.for_draft(object(), None, 96, None)


def _record(temperature: float, k_star: int, depth: int, nodes: int, tree_speedup: float,
            chain_speedup: float) -> dict:
    return {"k_star": k_star, "dtype": "bfloat16", "hardware": {"device": "cpu"},
            "measured": {"temperature": temperature},
            "measured_speedup": {"speedup": chain_speedup},
            "tree": {"depth": depth, "total_tokens": nodes, "speedup": tree_speedup}}


def test_each_temperature_drafts_from_the_record_measured_nearest_it():
    greedy = _record(0.0, 5, 4, 16, 2.3, 1.8)  # the tree wins greedily
    sampled = _record(1.0, 2, 2, 8, 1.05, 1.2)  # the chain wins when sampling
    spec = draft.merge_record(draft.merge_record(None, sampled), greedy)
    assert spec["k_star"] == 5 and set(spec["by_temperature"]) == {"1"}  # greedy on top
    plan = _plan("eagle", spec, temperature=0.0)
    assert (plan.tree, plan.k, plan.tree_size, plan.k_source) == (
        True, 4, 16, "speculation.json (T = 0, tree)")
    plan = _plan("eagle", spec, temperature=0.8)  # nearer 1 than 0
    assert (plan.tree, plan.k, plan.k_source) == (False, 2, "speculation.json (T = 1)")
    assert _plan("eagle", spec, temperature=0.5).k == 4  # a tie takes the lower temperature
    # the twin: without the sampled record every temperature drafts the greedy tree
    only_greedy = draft.merge_record(None, greedy)
    plan = _plan("eagle", only_greedy, temperature=1.0)
    assert (plan.tree, plan.k, plan.k_source) == (True, 4, "speculation.json (tree)")


def test_merging_a_record_replaces_its_temperature_and_keeps_the_rest():
    spec = draft.merge_record(None, _record(1.0, 2, 2, 8, 1.0, 1.2))
    assert spec["k_star"] == 2 and "by_temperature" not in spec  # only one: it is the top
    spec["batch"] = {"k_star": {"1": 3}}
    spec = draft.merge_record(spec, _record(0.0, 5, 4, 16, 2.3, 1.8))
    assert (spec["k_star"], spec["by_temperature"]["1"]["k_star"]) == (5, 2)
    assert spec["batch"] == {"k_star": {"1": 3}}  # shared keys are kept
    spec = draft.merge_record(spec, _record(1.0, 3, 3, 16, 1.1, 1.3))  # re-measured at T = 1
    assert (spec["k_star"], spec["by_temperature"]["1"]["k_star"]) == (5, 3)
    assert [draft.record_temperature(r) for r in draft.records_of(spec)] == [0.0, 1.0]
    assert "batch" not in spec["by_temperature"]["1"] and "batch" not in draft.records_of(spec)[0]
    # an older record without a measured temperature is the greedy one
    assert draft.record_at({"k_star": 1}, 1.0) == ({"k_star": 1}, 0.0)
