"""Bad settings and output paths are refused before any model loads, and nothing is overwritten:
eval/decode.py, eval/measure.py, eval/sweep.py and scripts/bench.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import QUESTIONS
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from draftsmith.eval import CONF_DIR, decode, measure, session, sweep
from draftsmith.scripts import bench


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test: the refusals must come first."""
    import draftsmith.data.target

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(draftsmith.data.target, "load_target", refuse)
    monkeypatch.setattr(session, "open_target", refuse)


@pytest.fixture
def questions(tmp_path) -> Path:
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


@pytest.fixture
def package(tmp_path) -> Path:
    """A folder that looks like a draft package to the path checks (they only read names)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "draftsmith.json").write_text("{}")
    return pkg


def _cfg(name: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


SAMPLING = [
    ("temperature=nan", r"temperature=nan is NaN \(not a number\); pass a finite temperature >= 0"),
    ("temperature=-1", (r"temperature=-1(\.0)? is negative; pass a finite temperature >= 0 "
                        r"\(0 = greedy, > 0 samples\)")),
    ("temperature=inf", r"temperature=inf is infinite"),
    ("top_p=2", r"top_p=2(\.0)? is outside \(0, 1\]; pass top_p in \(0, 1\] \(1\.0 = off\)"),
    ("top_p=nan", r"top_p=nan is NaN"),
    ("top_k=-1", r"top_k=-1 is negative; pass an integer top_k >= 0 \(0 = off\)"),
    ("top_k=1.5", r"top_k=1\.5 is not an integer"),
    ("noise_tolerance=nan", r"noise_tolerance=nan is NaN"),
    ("noise_tolerance=-0.1", r"noise_tolerance=-0\.1 is negative; pass a fraction >= 0"),
]


@pytest.mark.parametrize(("override", "message"), SAMPLING)
def test_decode_refuses_bad_sampling_before_loading(override, message, questions, no_model):
    with pytest.raises(ValueError, match=message):
        decode.run(_cfg("decode", f"prompts={questions}", override))


def test_decode_refuses_an_existing_directory_as_out_before_loading(questions, tmp_path,
                                                                    no_model):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "old.json").write_text("{}")
    before = _files(tmp_path)
    with pytest.raises(ValueError, match=rf"out={tmp_path / 'runs'} is an existing directory; "
                                         r"out is the JSON file to write: pass a file path, "
                                         rf"e\.g\. out={tmp_path / 'runs' / 'run.json'}"):
        decode.run(_cfg("decode", f"prompts={questions}", f"out={tmp_path / 'runs'}"))
    assert _files(tmp_path) == before


def test_decode_refuses_an_out_that_cannot_be_created_or_lands_on_an_input(
        questions, package, tmp_path, no_model):
    before = _files(tmp_path)
    with pytest.raises(ValueError, match=r"is a file, so the folder .*question\.jsonl cannot be "
                                         r"created; choose another out"):
        decode.run(_cfg("decode", f"prompts={questions}", f"out={questions / 'run.json'}"))
    with pytest.raises(ValueError, match=rf"out={questions} would overwrite prompts={questions}"):
        decode.run(_cfg("decode", f"prompts={questions}", f"out={questions}"))
    with pytest.raises(ValueError, match=rf"out={package / 'run.json'} writes into draft="):
        decode.run(_cfg("decode", f"prompts={questions}", f"draft={package}",
                        f"out={package / 'run.json'}"))
    with pytest.raises(ValueError, match=r"draft=.*nothere: no such folder, so not a draft "
                                         r"package"):
        decode.run(_cfg("decode", f"prompts={questions}", f"draft={tmp_path / 'nothere'}"))
    assert _files(tmp_path) == before


def test_decode_refuses_a_question_without_turns_before_loading(tmp_path, no_model):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(QUESTIONS[0]) + "\n"
                    + json.dumps({"question_id": 99, "category": "x", "turns": []}) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:2: question 99 has no turns"):
        decode.run(_cfg("decode", f"prompts={path}"))


@pytest.mark.parametrize(("override", "message"), SAMPLING[:2] + SAMPLING[3:4])
def test_measure_refuses_bad_sampling_before_loading(override, message, package, no_model):
    before = _files(package)
    with pytest.raises(ValueError, match=message):
        measure.run(_cfg("measure", f"draft={package}", override))
    assert _files(package) == before


def test_sweep_refuses_a_sweep_dir_in_a_draft_package(package, no_model):
    before = _files(package)
    cfg = _cfg("sweep", f"draft={package}", f"sweep_dir={package}")
    with pytest.raises(ValueError, match=rf"sweep_dir={package} writes into draft={package}"):
        sweep.task(cfg)
    with pytest.raises(ValueError, match=r"writes into the draft package or export"):
        sweep.validate(_cfg("sweep", "draft=lookup", f"sweep_dir={package / 'sweep'}"))
    assert _files(package) == before


def test_run_sweep_checks_every_job_before_the_first_runs(tmp_path):
    calls = []

    def runner(settings):
        calls.append(settings)
        return {"summary": {}, "samples": []}

    jobs = [{"draft": "lookup", "k": 1, "temperature": 0.0},
            {"draft": "lookup", "k": 2, "temperature": float("nan")}]
    with pytest.raises(ValueError, match="temperature=nan is NaN"):
        sweep.run_sweep(jobs, tmp_path / "sweep", runner, isolate=sweep.Isolate.NEVER,
                        progress=False, report=False)
    assert calls == [] and not (tmp_path / "sweep").exists()


def _bench_cfg(questions: Path, **over):
    return OmegaConf.merge(OmegaConf.load(bench.CONF_FILE), {
        "questions": str(questions), "eagle": None, "dtype": "float32", **over})


def test_bench_refuses_an_out_dir_that_is_a_draft_package(questions, package, no_model):
    before = _files(package)
    with pytest.raises(ValueError, match=rf"out_dir={package} writes into eagle={package}"):
        bench.run(_bench_cfg(questions, eagle=str(package), out_dir=str(package)))
    named = questions.with_name("results.json")  # what bench writes into out_dir
    named.write_text(questions.read_text())
    with pytest.raises(ValueError, match=rf"out_dir={named.parent} would overwrite "
                                         rf"questions={named}"):
        bench.run(_bench_cfg(named, out_dir=str(named.parent)))
    assert named.read_text() == questions.read_text()
    assert _files(package) == before


def test_bench_refuses_bad_temperatures_and_counts_before_loading(questions, tmp_path, no_model):
    with pytest.raises(ValueError, match=r"temperature=nan is NaN"):
        bench.run(_bench_cfg(questions, temperatures=[0.0, float("nan")],
                             out_dir=str(tmp_path / "b")))
    with pytest.raises(ValueError, match=r"limit must be >= 1, got 0"):
        bench.run(_bench_cfg(questions, limit=0, out_dir=str(tmp_path / "b")))
    assert not (tmp_path / "b").exists()
