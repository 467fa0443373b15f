"""Shared test fixtures: tiny random Llama targets built in-process (no downloads)."""
from __future__ import annotations

import os
import signal
import string
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# Two threads at most; under pytest-xdist (`make test-fast`: -n 2) the cores are split among
# the workers, since oversubscribed threads slow every worker.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
torch.set_num_threads(THREADS)


@pytest.fixture(autouse=True)
def _torch_threads():
    """Each test starts with the worker's thread count: code under test that sets its own (a
    training run sizes its threads to the machine) must not leave every later test in this
    worker oversubscribed (two workers of two threads each on two cores ran the sampling tests
    several times slower)."""
    yield
    if torch.get_num_threads() != THREADS:
        torch.set_num_threads(THREADS)


REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``slow`` and ``real`` tests first, each part in file order: on two workers the long
    tests start early and the short ones fill in around them, instead of one long test running
    alone at the end."""
    items.sort(key=lambda item: not any(item.get_closest_marker(m) for m in ("slow", "real")))


SHARED = REPO.parent / "shared"
MT_BENCH = SHARED / "data" / "mt_bench" / "question.jsonl"


SPECIALS = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "{{ '<|im_start|>system\nbe nice<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer (vocab < 96, ids 0/1/2 = pad/bos/eos) with a chat template.

    Matches `tiny_llama_config` (pad 0, bos 1, eos 2 = <|im_end|>).
    """
    chars = string.ascii_letters + string.digits + " \n.,!?:'-"
    vocab = {t: i for i, t in enumerate(SPECIALS + list(chars))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.add_special_tokens(SPECIALS)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="<|im_end|>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama_config(vocab: int = 96, hidden: int = 32, layers: int = 2, heads: int = 4,
                      kv: int = 2, **kw) -> LlamaConfig:
    """A tiny Llama config for unit tests (same architecture family as the real target)."""
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                       max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0, **kw)


def tiny_llama(seed: int = 0, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**kw)).eval()


@dataclass
class _TinyLoaded:
    model: LlamaForCausalLM
    tokenizer: object
    identity: object
    path: Path | None = None


def make_tiny_target(seed: int = 0, name: str = "tiny", **kw):
    """A LoadedTarget-like object around a tiny random Llama with a fake identity."""
    from draftsmith.data.identity import TargetIdentity

    model = tiny_llama(seed=seed, **kw)
    cfg = model.config
    ident = TargetIdentity(name=name, weights_sha256=f"{name}-{seed}-weights",
                           tokenizer_sha256=f"{name}-tok", vocab_size=cfg.vocab_size,
                           hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers)
    return _TinyLoaded(model=model, tokenizer=None, identity=ident)


@pytest.fixture(scope="session", autouse=True)
def _signing_key(tmp_path_factory):
    """Packages written by tests are signed with a throwaway key, never ~/.config's; trusted
    keys and the unsigned override come only from the tests themselves (subprocesses inherit
    this environment)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("DRAFTSMITH_SIGNING_KEY", str(tmp_path_factory.mktemp("signing") / "test-key.pem"))
    mp.delenv("DRAFTSMITH_TRUSTED_KEYS", raising=False)
    mp.delenv("DRAFTSMITH_ALLOW_UNSIGNED", raising=False)
    yield
    mp.undo()


@pytest.fixture
def tiny_target():
    return make_tiny_target()


@pytest.fixture(scope="session")
def real_target():
    """The real SmolLM2-135M-Instruct target (converted once, then read from the cache)."""
    from draftsmith.data.target import load_target

    return load_target()


# ----- a tiny target saved with a chat tokenizer, a question file and draft packages -----------
# shared by tests/eval/test_decode_cli.py (decode, measure) and tests/scripts/test_bench.py
QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a short poem.", "Again."]},
    {"question_id": 82, "category": "math", "turns": ["What is 12 plus 30?"]},
    {"question_id": 83, "category": "coding", "turns": ["Print hello in code."]},
]


def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Add small seeded noise to every trainable parameter (a draft that partly agrees)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return module.eval()


@pytest.fixture(scope="session")
def decode_setup(tmp_path_factory):
    """A tiny target dir (weights + chat tokenizer), a question file and a draft LM package.

    Session-scoped: built once for every test file that decodes, measures or benchmarks on it;
    tests copy a package before changing it.
    """
    import json

    from draftsmith.data.target import load_target
    from draftsmith.heads.draft_lm import DraftLMConfig, build_draft_lm
    from draftsmith.heads.package import save_package

    root = tmp_path_factory.mktemp("decode_cli")
    target_dir = root / "target"
    tiny_llama(seed=0).save_pretrained(target_dir)
    make_char_tokenizer().save_pretrained(target_dir)
    loaded = load_target(target_dir)
    questions = root / "question.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    cfg = DraftLMConfig.matching(loaded.model.config, 1, init="target")
    draft = randomize(build_draft_lm(cfg, loaded.model), seed=1)  # partly agrees with the target
    pkg = save_package(root / "lm", "lm", draft, cfg, loaded.identity, tokenizer=loaded.tokenizer)
    return {"root": root, "target": target_dir, "loaded": loaded, "questions": questions, "lm": pkg}


def draft_package(setup: dict, kind: str) -> tuple[Path, str]:
    """The ``kind`` ("lm", "medusa", "eagle", "dflash") package on ``decode_setup``'s target and
    the export format that reads back as it."""
    from draftsmith.heads.eagle import build_eagle
    from draftsmith.heads.eagle_config import EagleConfig
    from draftsmith.heads.medusa import MedusaConfig, build_medusa
    from draftsmith.heads.package import save_package

    model, ident = setup["loaded"].model, setup["loaded"].identity
    if kind == "lm":
        return setup["lm"], "hf"
    if kind == "medusa":
        cfg = MedusaConfig(num_heads=3, num_layers=1)
        module, fmt = randomize(build_medusa(cfg, model), seed=2), "medusa"
    elif kind == "dflash":  # masked with the EOS id: the target's padding row is all zeros
        from draftsmith.heads.family import get_family

        family = get_family("dflash")
        cfg = family.head_config({"block_size": 4, "mask_token_id": 2}, model.config)
        module, fmt = randomize(family.build(cfg, model), seed=4), "dflash"
    else:
        cfg = EagleConfig()
        module, fmt = randomize(build_eagle(cfg, model), seed=3), "eagle"
    return save_package(setup["root"] / kind, kind, module, cfg, ident), fmt


def eagle3_draft_logits(head, layers: dict, ids, steps: int = 2) -> list:
    """An EAGLE-3 head drafting greedily from the last position of ``ids`` (``layers``: hidden
    state id -> (1, T, H)): the target-vocabulary logits of each step."""
    feats = torch.cat([layers[i] for i in head.cfg.fuse_layers], -1)
    cache = head.new_cache()
    out = head(feats, ids, past_key_values=cache)[:, -1:]
    res = []
    for _ in range(steps):
        draft = head.compute_logits(out)[:, -1]
        full = torch.full((1, head.vocab_size), float("-inf"))
        full[:, head.d2t] = draft
        res.append(full)
        out = head(out, head.d2t[draft.argmax(-1)][:, None], past_key_values=cache)
    return res


# ----- the engines' environments, made while the other tests run ------------------------------
_prefetch: subprocess.Popen | None = None


def pytest_collection_finish(session: pytest.Session) -> None:
    """When a selected test is marked ``engines(name, ...)``, start making those engines'
    environments in a background process (``scripts.engine_envs.prepare``: the environment, and
    llama.cpp's sources for ``llama_server``; on a fresh clone about a minute with uv, mostly
    one core's work) so that it overlaps the tests before the engine
    check instead of adding to the suite; the check waits on ensure_env's lock. Its log is
    ``<engines_dir>/prefetch.log``; ``DRAFTSMITH_PREFETCH_ENGINES=0`` turns it off."""
    global _prefetch
    names = sorted({n for item in session.items for m in item.iter_markers("engines")
                    for n in m.args})
    if not names or os.environ.get("DRAFTSMITH_PREFETCH_ENGINES", "1") == "0":
        return
    from omegaconf import OmegaConf

    from draftsmith.scripts.engine_envs import READY

    root = REPO / str(OmegaConf.load(REPO / "conf" / "eval" / "engines.yaml").engines_dir)
    if all((root / n / READY).is_file() for n in names):
        return
    root.mkdir(parents=True, exist_ok=True)
    code = ("import os, sys; from pathlib import Path; "
            "from draftsmith.scripts.engine_envs import prepare; "
            "os.nice(5); [prepare(n, Path(sys.argv[1])) for n in sys.argv[2:]]")
    with open(root / "prefetch.log", "w") as log:  # the child keeps its own descriptor
        _prefetch = subprocess.Popen([sys.executable, "-c", code, str(root), *names], cwd=REPO,
                                     stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop an unfinished environment build (a run that ended early): the environment has no
    ready stamp, so the next ensure_env makes it again from scratch."""
    if _prefetch is not None and _prefetch.poll() is None:
        os.killpg(_prefetch.pid, signal.SIGTERM)
        _prefetch.wait(timeout=60)


# ----- the training tests that launch the recipe as separate processes ------------------------
@pytest.fixture(scope="session")
def one_process_reference(tmp_path_factory) -> Path:
    """The output folder of the one-process parity run (``PARITY`` in tests/train/launching.py,
    micro-batch 4), launched once per session with ``accelerate launch --config_file
    conf/accelerate/single.yaml``: the weights that the DDP and ZeRO-2 runs, on one machine and
    on two, must reproduce."""
    from tests.train.launching import PARITY, launch

    out = tmp_path_factory.mktemp("parity") / "one"
    launch(["--config_file", "conf/accelerate/single.yaml"], out,
           PARITY + ["train.micro_batch_size=4"], port=29621)
    return out
