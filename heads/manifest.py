"""The manifest of a package or export folder: sha256 and size of every file, and its checks.

``manifest.json`` lists every regular file of the folder except itself, the signature
(``heads.signing``, ``model.sig``) and a model card (``README.md`` at the top: documentation that
no loader reads, so a card can be written or corrected after signing without touching the signed
bytes; the signature ignores it too). Checking a folder against it refuses

* a listed file that is missing, truncated, longer or modified;
* any file on disk that is not listed (an unlisted ``speculation.json`` or extra weights could
  change what the loader does without changing a listed byte);
* symbolic links anywhere in the folder (they can point outside it) and other non-regular files;
* entries that are not confined to the folder: a path must be relative POSIX, normalised (no
  ``..``, no ``.``, no empty part, no leading ``/``, no backslash), so nothing outside the folder
  is ever opened or hashed;
* a malformed manifest (not an object, ``files`` not an object, an entry without ``sha256`` /
  ``size`` or with the wrong types), naming the entry.

The manifest proves nothing about who made the folder (anyone can rewrite it to match changed
files): ``heads.signing`` signs the folder, manifest included.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path, PureWindowsPath
from typing import Any

from draftsmith.data.identity import sha256_file

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
SIGNATURE = "model.sig"  # model-signing's default name; the one file the manifest cannot list
UNLISTED = (MANIFEST, SIGNATURE)
CARD = "README.md"  # the folder's model card: neither listed nor signed, never read by a loader
_HEX64 = re.compile(r"[0-9a-f]{64}")


class PackageIntegrityError(RuntimeError):
    """A package's files do not match its manifest (modified, truncated, missing or extra)."""

    def __init__(self, path: Path | str, problems: list[str], fix: str | None = None,
                 check: str = "integrity check"):
        self.path = Path(path)
        self.problems = list(problems)
        lines = "\n  - ".join(self.problems)
        fix = fix or ("re-export or re-download the package; to load it anyway (unsafe) pass "
                      "allow_unverified=True.")
        super().__init__(f"draft package {self.path} failed its {check}:\n  - {lines}\nFix: {fix}")


def walk(root: Path) -> tuple[list[str], list[str]]:
    """(regular files, refused entries) under ``root`` as sorted POSIX relative paths.

    Links are never followed: a symbolic link (to a file or a folder) and any other non-regular
    file (fifo, socket, device) is returned in the second list with the reason.
    """
    files, refused = [], []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(dirpath)
        for name in sorted(dirnames + filenames):
            p = base / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                refused.append(f"'{rel}' is a symbolic link (links are refused: they can point "
                               "outside the package)")
            elif name in filenames:
                if p.is_file():
                    files.append(rel)
                else:
                    refused.append(f"'{rel}' is not a regular file")
    return sorted(files), sorted(refused)


def path_problem(rel: Any) -> str | None:
    """Why ``rel`` is not a confined manifest path (relative, normalised POSIX), else None."""
    if not isinstance(rel, str) or not rel:
        return f"entry {rel!r} in {MANIFEST} is not a file path"
    if "\\" in rel or "\x00" in rel:
        return f"entry {rel!r} in {MANIFEST} has a backslash or NUL (paths are POSIX)"
    if rel.startswith("/") or PureWindowsPath(rel).drive:
        return f"entry {rel!r} in {MANIFEST} is an absolute path (paths are relative)"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return (f"entry {rel!r} in {MANIFEST} is not a normalised path inside the package "
                "(no '..', '.' or empty parts)")
    if rel in UNLISTED:
        return f"entry {rel!r} in {MANIFEST} names a file the manifest cannot list"
    return None


def structure_problems(manifest: Any) -> list[str]:
    """Problems of the manifest's shape and paths; nothing on disk is looked at."""
    if not isinstance(manifest, dict):
        return [f"'{MANIFEST}' is not a JSON object"]
    files = manifest.get("files")
    if not isinstance(files, dict):
        return [f"'files' in '{MANIFEST}' is {'missing' if files is None else 'not an object'}"]
    problems = []
    for rel, entry in files.items():
        bad = path_problem(rel)  # a normalised relative path stays inside (links: see walk)
        if bad is not None:
            problems.append(bad)
        elif not isinstance(entry, dict):
            problems.append(f"entry '{rel}' in {MANIFEST} is not an object with sha256 and size")
        else:
            for key in ("sha256", "size"):
                if key not in entry:
                    problems.append(f"entry '{rel}' in {MANIFEST} has no '{key}'")
            sha, size = entry.get("sha256"), entry.get("size")
            if "sha256" in entry and not (isinstance(sha, str) and _HEX64.fullmatch(sha)):
                problems.append(f"entry '{rel}' in {MANIFEST}: 'sha256' {sha!r} is not 64 "
                                "lowercase hex digits")
            if "size" in entry and (not isinstance(size, int) or isinstance(size, bool)
                                    or size < 0):
                problems.append(f"entry '{rel}' in {MANIFEST}: 'size' {size!r} is not a "
                                "non-negative integer")
    return problems


def write_manifest(root: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Hash every file in ``root`` and write ``manifest.json`` (atomically).

    Args:
        root: a package or export folder (no links in it).
        meta: extra fields recorded beside ``files`` (draft family, target identity, ...).

    Returns:
        The manifest dict.
    """
    root = Path(root)
    files, refused = walk(root)
    if refused:
        raise PackageIntegrityError(root, refused, fix="write real files, not links")
    listed = {rel: {"sha256": sha256_file(root / rel), "size": (root / rel).stat().st_size}
              for rel in files if rel not in UNLISTED and rel != CARD}
    manifest = {**meta, "files": listed}
    write_json_atomic(root / MANIFEST, manifest)
    return manifest


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of ``root``, its shape and paths checked (``PackageIntegrityError`` if not)."""
    path = Path(root) / MANIFEST
    if path.is_symlink() or not path.is_file():
        raise PackageIntegrityError(root, [f"'{MANIFEST}' is missing, so no file can be verified"])
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PackageIntegrityError(root, [f"'{MANIFEST}' is not valid JSON ({e})"]) from e
    problems = structure_problems(manifest)
    if problems:
        raise PackageIntegrityError(root, problems)
    return manifest


def manifest_problems(root: Path, manifest: dict[str, Any]) -> list[str]:
    """Compare the files in ``root`` with the manifest; one message per problem (empty = intact).

    Shape and path problems are returned without opening any file.
    """
    root = Path(root)
    on_disk, refused = walk(root)
    problems = structure_problems(manifest) + refused
    if problems:
        return problems
    listed = manifest["files"]
    for rel, entry in sorted(listed.items()):
        path = root / rel
        if path.is_symlink() or not path.is_file():
            problems.append(f"file '{rel}' is listed in {MANIFEST} but missing")
            continue
        size = path.stat().st_size
        if size != entry["size"]:
            how = "truncated" if size < entry["size"] else "longer than recorded"
            problems.append(f"file '{rel}' is {how}: {size} bytes on disk, {entry['size']} bytes "
                            f"in {MANIFEST}")
            continue
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            problems.append(f"file '{rel}' was modified: sha256 {digest[:16]}... on disk, "
                            f"{entry['sha256'][:16]}... in {MANIFEST}")
    for rel in on_disk:
        if rel not in listed and rel not in UNLISTED and rel != CARD:
            problems.append(f"file '{rel}' is not listed in {MANIFEST} (unlisted files are "
                            "refused)")
    return problems


def verify_manifest(root: Path, allow_unverified: bool = False) -> dict[str, Any]:
    """Verify ``root`` against its manifest; raise ``PackageIntegrityError`` or warn loudly.

    Returns:
        The manifest (an empty dict when it is unreadable and ``allow_unverified`` is set).
    """
    try:
        manifest = read_manifest(root)
        problems = manifest_problems(root, manifest)
    except PackageIntegrityError as e:
        if not allow_unverified:
            raise
        manifest, problems = {}, e.problems
    if problems:
        if not allow_unverified:
            raise PackageIntegrityError(root, problems)
        log.warning("!" * 78 + "\nLOADING AN UNVERIFIED DRAFT PACKAGE %s (allow_unverified=True):"
                    "\n  - %s\n" + "!" * 78, root, "\n  - ".join(problems))
    return manifest


def listed(manifest: dict[str, Any], rel: str) -> bool:
    """Whether ``rel`` is a file of the (verified) manifest: optional files are read only then."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    return isinstance(files, dict) and rel in files


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
