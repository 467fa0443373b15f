"""Make a release copy of a draft package: 16-bit weights, every other file as is, a new manifest;
or run a whole release recipe (``conf/release/<name>.yaml``: training stages, records, the copy).

    python scripts/release.py draft=outputs/eagle3_long/draft out=releases/eagle3-smollm2-135m
    python scripts/release.py recipe=eagle3-smollm2-135m [out=DIR] [dry_run=true]   # make release

Training keeps fp32 master weights; a release stores them in ``dtype`` (bf16 by default: the
weights a bf16 decode uses unchanged; fp32 decoding casts them back exactly); an int8 package
(``scripts/quantize.py``) stores its quantized Linears as int8 with per-channel scales
(``heads.weights.int8_state``: the int8 its decode uses, half the bytes). Weights over
``max_shard_mb`` go into shards; ``draft_vocab=N`` keeps a reduced-vocabulary head's N most
frequent draft ids (an LM head N rows tall). Integer and bool
buffers (an EAGLE-3 head's d2t / t2d maps) are kept. ``release.json`` records the source
package's manifest sha256, the command and the date. The source is verified first (its manifest
and target identity, and its signature: a trusted signer), and ``out`` must not be the source or
inside it. The release is signed with the local signing key (``heads.signing``); for an official
release point ``DRAFTSMITH_SIGNING_KEY`` at the release private key, whose public key is
``releases/keys/draftsmith-release.pub`` (trusted by every loader of this repository). The result
loads like any package (``heads.package.load_package``). A model card (``out/README.md``, not
signed) already in ``out`` is kept.

A recipe lists its steps in order: ``train`` steps run ``train/distill.py`` with those Hydra
overrides in one process through accelerate (as ``make demo`` does), ``run`` steps a python
command (``{out}`` is the release folder; a step with ``needs: FILE`` is skipped when FILE is
absent). Each command is printed before it runs; the first failure stops the recipe, and running
it again resumes (training continues from its newest checkpoint).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.eval import CONF_DIR
from draftsmith.heads.family import get_family
from draftsmith.heads.manifest import MANIFEST
from draftsmith.heads.package import PACKAGE_JSON, derive_package, verify_folder
from draftsmith.heads.peer_format import refuse_peer
from draftsmith.heads.vocab import cut_draft_vocab, package_token_counts
from draftsmith.heads.weights import (
    SCALE,
    int8_state,
    load_weights,
    save_weights,
    weight_files,
)

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
RECIPES = REPO / "conf" / "release"
TRAIN = ("accelerate", "launch", "--config_file", "conf/accelerate/single.yaml", "train/distill.py")


def release(draft: str | Path, out: str | Path, dtype: str = "bfloat16",
            command: str | None = None, max_shard_mb: float | None = None,
            draft_vocab: int | None = None) -> Path:
    """Write the release folder ``out`` from the package ``draft``; returns ``out``. Weights
    over ``max_shard_mb`` MB (None: no bound) are stored in shards of at most that size;
    ``draft_vocab``: a reduced-vocabulary head keeps only its that many most frequent draft ids
    (``heads.vocab.cut_draft_vocab``, ranked by the package's token counts)."""
    src, dst = Path(draft).resolve(), Path(out).resolve()
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(DTYPES)}")
    if dst == src or src in dst.parents:
        raise ValueError(f"out={out} is the package or inside it; choose a folder outside {draft}")
    refuse_peer(src, "release")
    if not (src / PACKAGE_JSON).is_file():
        raise ValueError(f"draft={draft} is not a draft package (no {PACKAGE_JSON})")
    verify_folder(src)
    info = json.loads((src / PACKAGE_JSON).read_text())
    if get_family(info["draft_kind"]).hf_model:
        raise ValueError("release.py handles head packages (eagle, medusa); a draft LM package is "
                         "a transformers folder: save it with save_pretrained(torch_dtype=...)")

    quant = info.get("quantization") or {}
    int8 = list(quant.get("modules") or []) if quant.get("scheme") == "int8" else []

    def write(tmp: Path) -> None:
        # an int8 package: its quantized Linears stored as the int8 a decode uses (computed from
        # the trained float32 weights, as its load would), the rest in dtype
        state = load_weights(src)
        if draft_vocab is not None:
            state = _cut(state, info, src, int(draft_vocab))
            (tmp / PACKAGE_JSON).write_text(json.dumps(info, indent=2))
        state = int8_state(state, int8)
        state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() and not k.endswith(SCALE)
                 else v for k, v in state.items()}
        bound = None if max_shard_mb is None else int(float(max_shard_mb) * 1e6)
        save_weights(state, tmp, {"format": "pt", "draft_kind": info["draft_kind"]}, bound)
        source_manifest = hashlib.sha256((src / MANIFEST).read_bytes()).hexdigest()
        record = {"source_package": str(draft), "source_manifest_sha256": source_manifest,
                  "weights_dtype": dtype, "command": command,
                  "int8_modules": len(int8), "draft_vocab_cut": draft_vocab,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds")}
        (tmp / "release.json").write_text(json.dumps(record, indent=2))

    return derive_package(src, dst, tuple(weight_files(src)), write)


def _cut(state: dict, info: dict, src: Path, size: int) -> dict:
    """``state`` cut to ``size`` draft ids (the package's token counts rank them; EOS kept), and
    ``info``'s head config updated to match, in place."""
    eos = (info.get("target_config") or {}).get("eos_token_id")
    vocab = int(state["t2d"].numel()) if "t2d" in state else 0
    state = cut_draft_vocab(state, package_token_counts(src, vocab), size,
                            [eos] if isinstance(eos, int) else list(eos or []))
    info["head_config"]["draft_vocab_size"] = size
    return state


class Step(NamedTuple):
    """One recipe command: skipped when ``needs`` (a file) is absent or ``unless`` exists."""
    argv: list[str]
    needs: str | None = None
    unless: str | None = None


def recipe_steps(name: str, out: str | None = None) -> list[Step]:
    """The commands of the recipe ``conf/release/<name>.yaml`` in order; ``out`` replaces the
    recipe's release folder."""
    path = RECIPES / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in RECIPES.glob("*.yaml"))
        raise ValueError(f"recipe={name}: there is no conf/release/{name}.yaml (recipes: {known})")
    spec = OmegaConf.to_container(OmegaConf.load(path))
    out = str(out or spec["out"])
    steps = []
    for i, step in enumerate(spec["steps"], 1):
        unknown = sorted(set(step) - {"train", "run", "needs", "unless"})
        if unknown:
            raise ValueError(f"{path}: step {i} has unknown keys {unknown}; a step takes train or "
                             "run, and optionally needs and unless")
        if ("train" in step) == ("run" in step):
            raise ValueError(f"{path}: a step has either train: [overrides] or run: [command], "
                             f"not {sorted(step)}")
        argv = ([str(Path(sys.executable).parent / TRAIN[0]), *TRAIN[1:], *step["train"]]
                if "train" in step else [sys.executable, *step["run"]])
        steps.append(Step([str(a).replace("{out}", out) for a in argv], step.get("needs"),
                          step.get("unless")))
    return steps


def run_recipe(name: str, out: str | None = None, dry_run: bool = False) -> None:
    """Run the recipe ``name`` from the repository root, step by step (``dry_run``: print only).
    A step with ``unless: FILE`` is skipped once FILE exists: a run that a later step continues
    (a training resumed with more steps) is not asked to stop short of where it got."""
    steps = recipe_steps(name, out)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    for i, step in enumerate(steps, 1):
        print(f"\n=== recipe={name} step {i}/{len(steps)}\n$ {shlex.join(step.argv)}", flush=True)
        if step.needs is not None and not (REPO / step.needs).is_file():
            print(f"skipped: it needs {step.needs}, which is absent", flush=True)
        elif step.unless is not None and (REPO / step.unless).exists():
            print(f"skipped: {step.unless} exists (this step has run)", flush=True)
        elif not dry_run and subprocess.run(step.argv, cwd=REPO, env=env, check=False).returncode:
            sys.exit(f"recipe={name} stopped: step {i} failed; fix it and run the same command "
                     "again to resume")


USAGE = ("usage: python scripts/release.py draft=PKG out=DIR [dtype=bfloat16|float16]\n"
         "       python scripts/release.py recipe=NAME [out=DIR] [dry_run=true]")


def run(cfg: DictConfig, command: str | None = None) -> Path | None:
    """Release ``cfg.draft`` into ``cfg.out``, or run the recipe ``cfg.recipe`` (options:
    ``conf/eval/release.yaml``); returns the release folder (None for a recipe)."""
    if cfg.recipe is not None:
        if cfg.draft is not None:
            sys.exit(f"recipe= and draft= are two modes: pass one\n{USAGE}")
        try:
            run_recipe(str(cfg.recipe), None if cfg.out is None else str(cfg.out),
                       str(cfg.dry_run).lower() in ("1", "true", "yes"))
        except ValueError as e:
            sys.exit(str(e))
        return None
    if cfg.draft is None or cfg.out is None:
        sys.exit(f"draft= and out= are required (or recipe=)\n{USAGE}")
    out = release(str(cfg.draft), str(cfg.out), str(cfg.dtype), command=command,
                  max_shard_mb=cfg.get("max_shard_mb"), draft_vocab=cfg.get("draft_vocab"))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"release written to {out} ({size / 2**20:.1f} MiB)")
    return out


@hydra.main(config_path=str(CONF_DIR), config_name="release", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Command line: Hydra overrides of ``conf/eval/release.yaml``."""
    run(cfg, command="python scripts/release.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
