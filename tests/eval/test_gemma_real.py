"""The second real target, Gemma 3 270M (a base model, 262,144 words, sliding-window layers):
drafts of every family built for it decode greedily identical to its own ``generate`` in fp32,
over a context longer than its 512-token window, and a base model gets the plain format."""
from __future__ import annotations

import pytest
import torch

from draftsmith.eval.decoding.decoder import SpeculativeDecoder
from draftsmith.eval.decoding.proposers import DraftLMProposer
from draftsmith.eval.decoding.proposers_eagle import EagleProposer
from draftsmith.eval.decoding.proposers_medusa import MedusaProposer, medusa_choices
from draftsmith.heads.family import get_family

pytestmark = [pytest.mark.real, pytest.mark.xdist_group("gemma")]  # one worker loads it
NEW = 8


@pytest.fixture(scope="module")
def gemma():
    from draftsmith.data.target import load_target

    return load_target("pkg:gemma3_270m")


def _greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


def _prompts(gemma) -> list[list[int]]:
    tok = gemma.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                   add_generation_prompt=True, tokenize=False)
    short = tok(text, add_special_tokens=False)["input_ids"]
    text = " ".join(f"Item {i} is a small blue box on the shelf." for i in range(60))
    long = tok(text)["input_ids"]
    assert len(long) > gemma.model.config.sliding_window  # windows are exercised
    return [list(short), list(long)]


def test_base_model_gets_the_plain_format(gemma):
    text = gemma.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                               add_generation_prompt=True, tokenize=False)
    assert "Hi" in text and text.rstrip().endswith(":")


@pytest.fixture(scope="module")
def references(gemma) -> list[tuple[list[int], list[int]]]:
    """(prompt, Gemma's own greedy continuation) for each prompt, generated once."""
    return [(p, _greedy(gemma.model, p)) for p in _prompts(gemma)]


@pytest.mark.parametrize("kind", ["eagle", "lm", "medusa"])
def test_every_family_decodes_exactly_on_gemma(gemma, references, kind):
    model = gemma.model
    family = get_family(kind)
    raw = {"eagle": {"layout": "eagle3", "fuse_layers": "auto", "draft_vocab_size": 4096},
           "lm": {"num_layers": 1, "init": "target"},
           "medusa": {"num_heads": 2, "num_layers": 1, "lm_head": "shared"}}[kind]
    cfg = family.head_config(raw, model.config)
    counts = torch.arange(model.config.vocab_size, 0, -1).float()
    torch.manual_seed(0)
    draft = family.build(cfg, model, token_counts=counts).eval()
    vocab = model.config.vocab_size
    for tree in (False, True):
        if kind == "eagle":
            prop = EagleProposer(draft, vocab, tree=tree, topk=3, total_tokens=8)
        elif kind == "lm":
            prop = DraftLMProposer(draft, vocab, tree=tree, topk=3, total_tokens=8)
        else:
            prop = MedusaProposer(draft, vocab, medusa_choices((2, 2) if tree else (1, 1)))
        dec = SpeculativeDecoder(model, prop, k=2, adaptive=False, fallback=False)
        for prompt, reference in references:
            got = dec.generate(prompt, max_new_tokens=NEW, temperature=0.0)
            assert got.output_ids == reference, (kind, tree, len(prompt))
