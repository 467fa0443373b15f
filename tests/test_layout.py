"""The house rules of the code base, checked: floors, file sizes, one family list, ruff clean."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from heads.family import FAMILIES

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("data", "heads", "train", "eval", "scripts")
LIBRARY = ("data", "heads", "train", "eval")  # the floors below scripts/
MAX_LINES = 500
# Where a family may be named: the registry and the family's own head module and proposer.
FAMILY_FILES = {"heads/family.py", "heads/draft_lm.py", "heads/medusa.py", "heads/eagle.py",
                "eval/proposers.py", "eval/proposers_medusa.py", "eval/proposers_eagle.py"}


def _sources(dirs: tuple[str, ...]) -> list[Path]:
    return sorted(p for d in dirs for p in (REPO / d).rglob("*.py"))


def family_comparisons(text: str) -> list[str]:
    """Lines comparing something with a family's name (``kind == "lm"``, ``in ("lm", ...)``)."""
    names = "|".join(map(re.escape, FAMILIES))
    literal = rf"[\"'](?:{names})[\"']"
    pattern = re.compile(rf"(?:==|!=|\bin|\bnot in)\s*\(?\s*{literal}|{literal}\s*(?:==|!=)")
    return [line.strip() for line in text.splitlines() if pattern.search(line)]


def test_the_family_check_catches_a_branch_on_a_family_name():
    assert family_comparisons('    if pkg.kind == "medusa":\n        pass')
    assert family_comparisons("if kind in ('lm', 'eagle'):")
    assert not family_comparisons('proposer = "eval.proposers.DraftLMProposer"')


def test_no_code_branches_on_a_family_name_outside_the_family_files():
    found = {}
    for path in _sources(PACKAGES):
        rel = path.relative_to(REPO).as_posix()
        if rel not in FAMILY_FILES and (hits := family_comparisons(path.read_text())):
            found[rel] = hits
    assert not found, f"branches on a family name (ask heads.family instead): {found}"


def test_library_packages_do_not_import_scripts():
    bad = {p.relative_to(REPO).as_posix() for p in _sources(LIBRARY)
           if re.search(r"^\s*(from scripts[ .]|import scripts\b)", p.read_text(), re.MULTILINE)}
    assert not bad, f"imports from scripts/ run back up the floors: {sorted(bad)}"


def test_no_source_file_is_over_500_lines():
    long = {p.relative_to(REPO).as_posix(): n for p in _sources(PACKAGES)
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_ruff_is_clean():
    ruff = str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        ruff = shutil.which("ruff") or ruff
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (make install adds it)")
    out = subprocess.run([ruff, "check", *PACKAGES, "tests"], cwd=REPO, capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stdout[-3000:]
