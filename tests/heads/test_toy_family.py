"""A fifth draft family defined here, in one module, registered from outside ``heads/family.py``:
it trains with the recipe, loads, decodes losslessly (one prompt and a batch), resolves in the
benchmark's config and exports in the format it declares, with no other file knowing of it.

The toy reuses the draft LM's machinery (a one-layer causal LM copied from the target) under its
own name, proposer, batched drafter and export format; every family hook it does not override
is the ``DraftFamily`` default.
"""
from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir

from draftsmith.data.target import load_target
from draftsmith.data.tiny import target_path_from_config
from draftsmith.eval import CONF_DIR
from draftsmith.eval.decoding.batch import BatchDecoder
from draftsmith.eval.decoding.batch_drafters import BatchDraftLM, batch_drafter_for
from draftsmith.eval.decoding.decoder import SpeculativeDecoder
from draftsmith.eval.decoding.proposers import DraftLMProposer
from draftsmith.eval.draft import build_proposer, load_draft, settle
from draftsmith.heads.exports import export_format, format_family, import_export
from draftsmith.heads.family import FAMILIES, get_family, register, unregister
from draftsmith.heads.family_base import ExportFormat
from draftsmith.heads.family_lm import DraftLMFamily
from draftsmith.heads.weights import WEIGHTS
from draftsmith.scripts.bench_drafts import draft_paths, package_k
from draftsmith.scripts.export import export_package
from tests.eval.test_decoder import hf_greedy
from tests.train.launching import TINY, compose_config, run_inprocess

NAME = "toy"
FORMAT = "toy-hf"


class ToyProposer(DraftLMProposer):
    """The toy's proposer: the draft LM's, under the toy's name."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.name = NAME + ("-tree" if self.tree else "")


class ToyFamily(DraftLMFamily):
    """A one-layer causal LM over the target's vocabulary, exported in its own ``toy-hf``."""

    name = NAME
    proposer = f"{__name__}.ToyProposer"
    batch_drafter = "draftsmith.eval.decoding.batch_drafters.BatchDraftLM"
    exports = (ExportFormat(FORMAT, "draftsmith.scripts.export_formats._write_hf",
                            "draftsmith.heads.exports._read_hf", WEIGHTS, "vllm", "draft_model"),)


@pytest.fixture(scope="module")
def toy():
    """The toy family, registered for this module's tests and taken out after them."""
    family = register(ToyFamily())
    yield family
    assert unregister(NAME) is family
    assert NAME not in FAMILIES


@pytest.fixture(scope="module")
def target():
    """The recipe's tiny random target (``debug=tiny``), loaded as training loads it."""
    cfg = compose_config(TINY + ["draft=lm"])
    return load_target(target_path_from_config(cfg.target))


@pytest.fixture(scope="module")
def trained(toy, tmp_path_factory):
    """A few steps of the recipe (``train/distill.py``) with ``draft.kind=toy``: its package."""
    out = tmp_path_factory.mktemp("toy")
    run_inprocess(TINY + ["draft=lm", f"draft.kind={NAME}", "draft.config.num_layers=1",
                          "train.max_steps=3", "train.eval_every=3", "train.save_every=3",
                          f"out_dir={out}"])
    return out / "draft"


def test_registering_refuses_a_taken_name_or_format_and_unregisters(toy):
    assert get_family(NAME) is toy and format_family(FORMAT) is toy
    with pytest.raises(ValueError, match="registered already"):
        register(ToyFamily())

    class Thief(ToyFamily):
        name = "thief"

    with pytest.raises(ValueError, match="belong to another family"):
        register(Thief())
    assert "thief" not in FAMILIES


def test_trains_and_loads_as_its_own_family(toy, trained):
    pkg = load_draft(trained)
    assert pkg.family is toy
    assert pkg.module.config.num_hidden_layers == 1


def test_decodes_losslessly_alone_and_in_a_batch(toy, trained, target):
    pkg = load_draft(trained, target)
    model = target.model.eval()
    vocab = int(model.config.vocab_size)
    plan = settle({"k": 3, "tree": "chain", "dtype": "float32", "device": "cpu"}, pkg)
    proposer = build_proposer(pkg, plan, target, vocab)
    assert isinstance(proposer, ToyProposer) and proposer.name == NAME
    assert isinstance(batch_drafter_for(proposer), BatchDraftLM)
    prompts = [[1, 5, 9, 14, 22, 30], [1, 7, 7, 12, 40]]
    single = SpeculativeDecoder(model, proposer, k=3, adaptive=False, fallback=False)
    got = BatchDecoder(model, proposer, k=3, fallback=False).generate(prompts, max_new_tokens=16)
    for prompt, res in zip(prompts, got):
        want = hf_greedy(model, prompt, 16, None)
        assert single.generate(prompt, max_new_tokens=16).output_ids == want
        assert res.output_ids == want
    tree = build_proposer(pkg, settle({"k": 3, "tree": "tree", "tree_size": 6}, pkg), target,
                          vocab)
    tree_dec = SpeculativeDecoder(model, tree, k=3, adaptive=False, fallback=False)
    assert tree.tree and tree_dec.generate(prompts[0], max_new_tokens=16).output_ids == hf_greedy(
        model, prompts[0], 16, None)
    with pytest.raises(ValueError, match="drafts trees with the eagle drafts only"):
        batch_drafter_for(tree)


def test_the_bench_config_resolves_its_package(toy, trained):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="bench", overrides=[f"+{NAME}={trained}", "eagle=null"])
    assert draft_paths(cfg) == {NAME: str(trained)}
    assert package_k(str(trained), None) == (4, "default")


def test_exports_in_its_format_and_reads_back(toy, trained, target, tmp_path):
    out = export_package(trained, FORMAT, tmp_path / "export", target=target)
    assert (out / export_format(FORMAT).weights_file).is_file()
    back = import_export(out, target=target)
    assert back.family is toy
    pkg = load_draft(trained)
    for name, value in pkg.module.state_dict().items():
        assert torch.equal(back.module.state_dict()[name], value), name
