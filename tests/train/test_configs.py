"""Every YAML in conf/ composes, and the composed distillation configs validate."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from draftsmith.train.config import ConfigError, validate_config

CONF = Path(__file__).resolve().parents[2] / "conf"
EVAL_CONF = CONF / "eval"  # the evaluation / export commands, outside the training groups
EVAL_NAMES = sorted(p.stem for p in EVAL_CONF.glob("*.yaml"))
RELEASE_CONF = CONF / "release"  # release recipes (scripts/release.py recipe=NAME), not a group
RECIPES = sorted(p.stem for p in RELEASE_CONF.glob("*.yaml"))
MAX_PRESETS = 10  # recipes, not lab history: quick / CPU / GPU per family


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _compose(overrides: list[str], name: str = "distill", conf: Path = CONF):
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


GROUPS = ["target", "draft", "data", "loss", "optim", "launcher", "logging"]
CASES = [f"{g}={o}" for g in GROUPS for o in _options(g)]
CASES += [f"experiment={o}" for o in _options("experiment")]
CASES += [f"debug={o}" for o in _options("debug")]


@pytest.mark.parametrize("override", CASES)
def test_every_option_composes_and_validates(override):
    cfg = _compose([override])
    OmegaConf.resolve(cfg)
    validate_config(cfg)


def test_only_the_training_entry_point_is_top_level():
    assert [p.stem for p in CONF.glob("*.yaml")] == ["distill"]


@pytest.mark.parametrize("name", EVAL_NAMES)
def test_eval_configs_compose(name):
    cfg = _compose([], name=name, conf=EVAL_CONF)
    assert len(cfg) > 0


@pytest.mark.parametrize("name", EVAL_NAMES)
def test_draft_is_a_plain_value_in_eval_configs(name):
    """``draft=DIR`` sets a string: conf/eval/ has no ``draft`` config group to clash with."""
    has_draft = "draft" in list(_compose([], name=name, conf=EVAL_CONF))  # also when ???
    override = ("" if has_draft else "+") + "draft=/some/dir"
    assert _compose([override], name=name, conf=EVAL_CONF).draft == "/some/dir"


def test_measure_config_is_decode_plus_its_keys():
    decode = _compose([], name="decode", conf=EVAL_CONF)
    measure = _compose([], name="measure", conf=EVAL_CONF)
    assert set(decode) < set(measure) and measure.prompts == "sharegpt" and measure.k is None
    assert all(measure[k] == decode[k] for k in decode if k not in ("prompts", "k"))


def test_every_yaml_is_covered():
    """A new config group or file must be added to this test (no YAML escapes composition)."""
    covered = set(GROUPS) | {"experiment", "debug", "accelerate", "deepspeed", "eval", "release"}
    groups = {p.name for p in CONF.iterdir() if p.is_dir()}
    assert groups <= covered, f"groups not composed by tests: {groups - covered}"


def test_presets_are_few_and_start_from_scratch():
    """conf/experiment holds recipes: at most 10, none continuing another run's output (a chain
    of runs is a release recipe in conf/release/); a packaged model (``pkg:<key>``, e.g. the
    target's smaller sibling) may be a draft LM's starting point."""
    names = _options("experiment")
    assert "quickstart" in names and len(names) <= MAX_PRESETS, names
    for name in names:
        init = _compose([f"experiment={name}"]).draft.init_from
        assert init is None or str(init).startswith("pkg:"), (
            f"experiment={name} continues {init}: make it a release recipe")


def _train_stages(recipe: str) -> tuple[list[list[str]], list[dict]]:
    steps = OmegaConf.to_container(OmegaConf.load(RELEASE_CONF / f"{recipe}.yaml"))["steps"]
    return [s["train"] for s in steps if "train" in s], steps


@pytest.mark.parametrize("recipe", RECIPES)
def test_release_recipe_stages_compose_validate_and_chain(recipe):
    """Every training stage composes and validates; a stage continues only what an earlier step
    of the same recipe wrote (a stage's draft package or a run step's out=)."""
    stages, steps = _train_stages(recipe)
    assert stages, f"conf/release/{recipe}.yaml has no train step"
    written: set[str] = set()
    for step in steps:
        if "run" in step:
            written |= {a.split("=", 1)[1] for a in step["run"] if a.startswith("out=")}
            continue
        cfg = _compose(step["train"])
        OmegaConf.resolve(cfg)
        validate_config(cfg)
        init = cfg.draft.init_from
        assert init is None or init in written, f"{recipe}: {init} is not written before"
        written.add(f"{cfg.out_dir}/draft")


def _leaves(d: dict, prefix: str = ""):
    for key, value in d.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_the_release_recipe_trains_what_the_release_records():
    """The last stage of conf/release/eagle3-smollm2-135m.yaml composes to the released head's
    training_config.yaml, key for key: dtypes measured at start (auto) aside, and the head it
    continues, which the release names by the folder it then had (releases/...)."""
    released = OmegaConf.to_container(OmegaConf.load(
        CONF.parent / "releases" / "eagle3-smollm2-135m" / "training_config.yaml"))
    cfg = OmegaConf.create(OmegaConf.to_container(
        _compose(_train_stages("eagle3-smollm2-135m")[0][-1]), resolve=True))
    measured = {"target.dtype": "auto", "train.mixed_precision": "auto", "data.cache.dtype": "auto"}
    for key, want in _leaves(released):
        got = OmegaConf.select(cfg, key, default="<absent>")
        if key.endswith("_target_"):  # class paths follow the code's module layout
            continue
        if key == "draft.init_from":
            assert want == "releases/eagle3-smollm2-135m"
            assert got == "outputs/eagle3_engine/release"
        elif key in measured:
            assert got == measured[key], key
        else:
            assert got == want, f"{key}: the recipe gives {got!r}, the release recorded {want!r}"


@pytest.mark.parametrize("override,key", [
    ("draft.kind=transformer", "draft.kind"),
    ("train.max_steps=0", "train.max_steps"),
    ("optim.lr=-1", "optim.lr"),
    ("optim.lr=0", "optim.lr"),
    ("draft.num_positions=0", "draft.num_positions"),
    ("train.mixed_precision=fp8", "train.mixed_precision"),
    ("+loss.weights.mse=1.0", "loss.weights"),
    ("loss.temperature=0", "loss.temperature"),
    ("draft.config.draft_vocab_size=-5", "draft_vocab_size"),
])
def test_bad_values_name_the_key(override, key):
    cfg = _compose([override])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_config(cfg)


def test_validation_against_target_names_the_key():
    from draftsmith.train.config import validate_against_target

    cfg = _compose(["draft.config.draft_vocab_size=100000"])
    with pytest.raises(ConfigError, match=r"draft_vocab_size=100000 exceeds"):
        validate_against_target(cfg, vocab_size=49152, hidden_size=576, num_layers=30)
    cfg = _compose(["draft=lm", "+draft.config.hidden_size=128"])
    with pytest.raises(ConfigError, match=r"hidden_size=128 does not fit"):
        validate_against_target(cfg, vocab_size=49152, hidden_size=576, num_layers=30)
