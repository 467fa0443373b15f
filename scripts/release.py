"""Make a release copy of a draft package: 16-bit weights, every other file as is, a new manifest.

    python scripts/release.py draft=outputs/eagle3_long/draft out=releases/eagle3-smollm2-135m

Training keeps fp32 master weights; a release stores them in ``dtype`` (bf16 by default: the
weights a bf16 decode uses unchanged; fp32 decoding casts them back exactly). Integer and bool
buffers (an EAGLE-3 head's d2t / t2d maps) are kept. ``release.json`` records the source
package's manifest sha256, the command and the date. The source is verified first (its manifest
and target identity, and its signature: a trusted signer), and ``out`` must not be the source or
inside it. The release is signed with the local signing key (``heads.signing``); for an official
release point ``DRAFTSMITH_SIGNING_KEY`` at the release private key, whose public key is
``releases/keys/draftsmith-release.pub`` (trusted by every loader of this repository). The result
loads like any package (``heads.package.load_package``).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch
from safetensors.torch import load_file, save_file

from heads.family import WEIGHTS, get_family
from heads.package import MANIFEST, PACKAGE_JSON, derive_package, verify_folder

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def release(draft: str | Path, out: str | Path, dtype: str = "bfloat16",
            command: str | None = None) -> Path:
    """Write the release folder ``out`` from the package ``draft``; returns ``out``."""
    src, dst = Path(draft).resolve(), Path(out).resolve()
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(DTYPES)}")
    if dst == src or src in dst.parents:
        raise ValueError(f"out={out} is the package or inside it; choose a folder outside {draft}")
    if not (src / PACKAGE_JSON).is_file():
        raise ValueError(f"draft={draft} is not a draft package (no {PACKAGE_JSON})")
    verify_folder(src)
    info = json.loads((src / PACKAGE_JSON).read_text())
    if get_family(info["draft_kind"]).hf_model:
        raise ValueError("release.py handles head packages (eagle, medusa); a draft LM package is "
                         "a transformers folder: save it with save_pretrained(torch_dtype=...)")

    def write(tmp: Path) -> None:
        state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v
                 for k, v in load_file(str(src / WEIGHTS)).items()}
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt",
                                                      "draft_kind": info["draft_kind"]})
        source_manifest = hashlib.sha256((src / MANIFEST).read_bytes()).hexdigest()
        record = {"source_package": str(draft), "source_manifest_sha256": source_manifest,
                  "weights_dtype": dtype, "command": command,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds")}
        (tmp / "release.json").write_text(json.dumps(record, indent=2))

    return derive_package(src, dst, (WEIGHTS,), write)


def main(argv: list[str]) -> None:
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    unknown = set(args) - {"draft", "out", "dtype"}
    if unknown or "draft" not in args or "out" not in args:
        sys.exit(f"usage: python scripts/release.py draft=PKG out=DIR [dtype=bfloat16|float16]"
                 f"{f' (unknown: {sorted(unknown)})' if unknown else ''}")
    out = release(args["draft"], args["out"], args.get("dtype", "bfloat16"),
                  command="python scripts/release.py " + " ".join(argv))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"release written to {out} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main(sys.argv[1:])
