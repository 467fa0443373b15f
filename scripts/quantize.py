"""Make an INT8 or INT4 copy of a draft package (``heads/quantize.py``: weight-only int8 by
default).

    python scripts/quantize.py draft=releases/eagle3-smollm2-135m out=outputs/eagle3-int8
    python scripts/quantize.py draft=PKG out=DIR scheme=int4
    python scripts/quantize.py draft=PKG out=DIR scheme=int8_dynamic

Every Linear of the draft is quantized but an EAGLE head's ``fc`` (its input is the target's
features, outlier channels included) and the LM head of a draft LM or of a full-vocabulary
EAGLE head (a draft vocabulary cuts rows out of it); the copy records the scheme and the
modules in ``draftsmith.json["quantization"]``, keeps the trained weights (the quantized ones
are made from them at load, the same every time), drops ``speculation.json`` (its K* and costs were
measured on the float draft: run ``eval/measure.py`` on the copy), and is signed anew with the
local key. It loads like any package.
"""
from __future__ import annotations

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig

from draftsmith.eval import CONF_DIR
from draftsmith.heads.package import PACKAGE_JSON, SPECULATION, derive_package, load_package
from draftsmith.heads.quantize import SCHEMES, record


def quantize_package(draft: str | Path, out: str | Path, scheme: str = "int8") -> Path:
    """Write the quantized copy ``out`` of the package ``draft``; returns ``out``."""
    src, dst = Path(draft).resolve(), Path(out).resolve()
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r}: allowed {SCHEMES}")
    if dst == src or src in dst.parents or dst in src.parents:
        raise ValueError(f"out={out} is the package, inside it or above it; choose a folder "
                         f"beside {draft}")
    pkg = load_package(src)  # verified: manifest, signature, identity
    if pkg.info.get("quantization"):
        raise ValueError(f"draft={draft} is already quantized "
                         f"({pkg.info['quantization']['scheme']})")
    # left float: an EAGLE head's fc, whose input is the target's features with their outlier
    # channels (int8 there cost 3.5 points of top-1 agreement with the float head, the rest of
    # the head 1.3), and a full-vocabulary LM head (a draft vocabulary cuts rows out of it)
    reduced = bool(getattr(pkg.module, "reduced", False))
    skip = ("fc",) if reduced else ("fc", "lm_head")
    info = json.loads((src / PACKAGE_JSON).read_text())
    info["quantization"] = record(pkg.module, scheme, skip)

    def write(tmp: Path) -> None:
        (tmp / PACKAGE_JSON).write_text(json.dumps(info, indent=2))

    # speculation.json left out: its K* and costs were measured on the float draft
    return derive_package(src, dst, (SPECULATION, PACKAGE_JSON), write)


def run(cfg: DictConfig) -> Path:
    """Quantize ``cfg.draft`` into ``cfg.out`` (options: ``conf/eval/quantize.yaml``)."""
    out = quantize_package(str(cfg.draft), str(cfg.out), str(cfg.scheme))
    n = len(json.loads((out / PACKAGE_JSON).read_text())["quantization"]["modules"])
    print(f"quantized copy written to {out} ({n} Linear modules {cfg.scheme})")
    return out


@hydra.main(config_path=str(CONF_DIR), config_name="quantize", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Command line: Hydra overrides of ``conf/eval/quantize.yaml``."""
    run(cfg)


if __name__ == "__main__":
    main()
