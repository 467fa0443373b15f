"""``format=gguf`` for EAGLE-3 heads and DFlash drafters: llama.cpp's own converter on a layout it
reads, then the GGUF checked against the package.

llama.cpp runs these drafts in its C++ programs only (``llama-server --spec-type draft-eagle3 |
draft-dflash``, ``scripts/engines.py`` engine ``llama_server``). The draft is staged in the layout
the converter of the vendored llama.cpp (``convert_hf_to_gguf.py`` of the pinned
llama-cpp-python sdist) accepts, and converted in the ``llama_server`` environment under
``.engines/`` (its torch and transformers; never in ``.venv``):

* EAGLE-3 (``DraftFamily.gguf_layout`` ``eagle3``): the ``format=eagle3`` files
  (``LlamaForCausalLMEagle3``) with the layer ids also at the top level of ``config.json``
  (``eagle_aux_hidden_state_layer_ids``): the converter reads them only there and otherwise
  uses ``[2, N // 2, N - 3]`` without a word; its log line ``EAGLE-3: target_layers = [...]`` is
  checked against the head's. llama.cpp captures the input of target layer i for id i
  (``t_layer_inp[i]``), transformers' ``hidden_states[i]``, the ids the head was trained on.
* DFlash (``zlab_dflash``): z-lab's ``DFlashDraftModel`` layout, the ``format=dflash`` weights
  with a Qwen3 config, ``block_size`` and ``dflash_config`` (``mask_token_id``,
  ``target_layer_ids`` in z-lab's count, our ids - 1: the converter adds 1 back).

``--target-model-dir`` gets the target's ``config.json`` and tokenizer, made readable by the
converter's transformers 4.57 (a top-level ``rope_theta``, the fast tokenizer's 4.x class name).
The GGUF is then read back (:func:`gguf_problems`): architecture, ``<arch>.target_layers``,
the draft-to-target vocabulary map (``d2t``, absolute target ids), block size and mask id, and
the vocabulary (the target's tokens in order); any difference refuses the export.

llama.cpp's EAGLE-3 and DFlash read the target's per-layer inputs, which only some of its model
graphs publish (``src/models/<arch>.cpp`` setting ``t_layer_inp``): a target whose graph does
not (qwen2, phi3, gemma3, ...) would abort inside llama.cpp (``layer input tensor is null``), so
its export is refused with that reason.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from draftsmith.heads.package import DraftPackage
from draftsmith.scripts.engine_envs import (
    ENGINES_DIR,
    engine_env,
    ensure_env,
    llama_cpp_sources,
    note,
)
from draftsmith.scripts.export_dflash import transformer_layer_config, write_dflash
from draftsmith.scripts.export_formats import (
    TOKENIZER_FILES,
    ExportError,
    WriteOptions,
    _portable_tokenizer_config,
    _write_eagle3,
    _write_gguf,
    _write_json,
    readable_by_older_loaders,
)
from draftsmith.scripts.export_gguf import GGUF_FILE

OUTTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
# transformers model types whose llama.cpp graph publishes per-layer inputs (src/models/*.cpp
# that set t_layer_inp in the vendored llama.cpp: llama.cpp, qwen3.cpp, qwen3moe.cpp, ...)
LAYER_INPUTS = ("llama", "mistral", "qwen3", "qwen3_moe", "qwen3_next", "gemma4", "lfm2",
                "gpt_oss", "minimax_m2", "nemotron_h")
CONVERTER_LAYERS = re.compile(r"EAGLE-3: target_layers = \[([^\]]*)\]")


def target_refusal(target_config: dict) -> str | None:
    """Why llama.cpp cannot run an EAGLE-3 or DFlash draft for this target (None: it can)."""
    kind = (target_config.get("text_config") or target_config).get("model_type")
    if kind in LAYER_INPUTS:
        return None
    return (f"llama.cpp's EAGLE-3 and DFlash drafts read the target's per-layer inputs, which its "
            f"{kind} graph does not publish (src/models/{kind}.cpp sets no t_layer_inp; llama.cpp "
            f"aborts with 'layer input tensor is null'); targets it runs them for: "
            f"{', '.join(LAYER_INPUTS)}. Serve this draft in vLLM (format=eagle3 / dflash)")


# ----------------------------------------------------------------------------- staging
def stage_eagle3(pkg: DraftPackage, dst: Path, opts: WriteOptions) -> list[int]:
    """The ``format=eagle3`` files with the layer ids where the converter reads them."""
    _write_eagle3(pkg, dst, opts)
    cfg = json.loads((dst / "config.json").read_text())
    ids = list(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    cfg["eagle_aux_hidden_state_layer_ids"] = ids
    _write_json(dst / "config.json", cfg)
    return ids


def stage_zlab_dflash(pkg: DraftPackage, dst: Path, opts: WriteOptions) -> list[int]:
    """z-lab's ``DFlashDraftModel`` layout: the ``format=dflash`` weights (the same tensor names,
    ``fc`` columns in ascending layer order) under a Qwen3 config with ``dflash_config``."""
    write_dflash(pkg, dst, opts)
    head = pkg.head_config
    ids = sorted(head.fuse_layers)
    cfg = transformer_layer_config(pkg, opts.dtype)
    cfg.update(architectures=["DFlashDraftModel"], block_size=int(head.block_size),
               num_target_layers=int(pkg.info["target"]["num_layers"]),
               dflash_config={"mask_token_id": int(head.mask_token_id),
                              "target_layer_ids": [i - 1 for i in ids],
                              "block_size": int(head.block_size)})
    _write_json(dst / "config.json", cfg)
    return ids


STAGERS = {"eagle3": stage_eagle3, "zlab_dflash": stage_zlab_dflash}
ARCH = {"eagle3": "eagle3", "zlab_dflash": "dflash"}  # the GGUF architecture of each layout


def stage_target(target_dir: Path, dst: Path) -> None:
    """The target's config and tokenizer as the converter's transformers 4.57 reads them."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    _write_json(dst / "config.json", readable_by_older_loaders(cfg))
    for name in TOKENIZER_FILES:
        if (Path(target_dir) / name).is_file():
            shutil.copy2(Path(target_dir) / name, dst / name)
    _portable_tokenizer_config(dst)


# ----------------------------------------------------------------------------- converting
def converter_layers(log: str) -> list[int] | None:
    """The layer ids the converter's log says it wrote for an EAGLE-3 draft (None: no line)."""
    m = CONVERTER_LAYERS.search(log)
    return None if m is None else [int(x) for x in m.group(1).split(",") if x.strip()]


def run_converter(draft_dir: Path, target_dir: Path, out: Path, outtype: str,
                  root: Path = ENGINES_DIR) -> str:
    """The vendored ``convert_hf_to_gguf.py`` in the ``llama_server`` environment -> its log."""
    python = ensure_env("llama_server", root)
    script = llama_cpp_sources(root) / "convert_hf_to_gguf.py"
    cmd = [str(python), str(script), str(draft_dir), "--target-model-dir", str(target_dir),
           "--outtype", outtype, "--outfile", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env=engine_env("llama_server", python.parents[1]))
    log = done.stdout + done.stderr
    if done.returncode or not out.is_file():
        raise ExportError(f"llama.cpp's converter failed (exit {done.returncode}):\n{log[-3000:]}")
    return log


def write_gguf_export(pkg: DraftPackage, tmp: Path, opts: WriteOptions) -> None:
    """``format=gguf`` of any family that has it: a draft LM written directly
    (``scripts/export_gguf.py``), the others through the converter."""
    if pkg.family.gguf_layout is None:
        _write_gguf(pkg, tmp, opts)
        return
    write_converted_gguf(pkg, tmp, opts, opts.target_dir,
                         Path(opts.engines_dir) if opts.engines_dir else ENGINES_DIR)


def write_converted_gguf(pkg: DraftPackage, tmp: Path, opts: WriteOptions, target_dir: Any,
                         root: Path = ENGINES_DIR) -> None:
    """Stage the draft for its family's layout, convert it, check the GGUF (module docstring)."""
    layout = pkg.family.gguf_layout
    if opts.dtype not in OUTTYPES:
        raise ExportError(f"format=gguf writes float32, bfloat16 or float16, not {opts.dtype}")
    why = target_refusal(pkg.info["target_config"] or {})
    if why:
        raise ExportError(why)
    if target_dir is None:
        raise ExportError(f"format=gguf of a {pkg.family.name} draft needs the target's folder "
                          "(config and tokenizer) for llama.cpp's converter: load the target "
                          "(target_path=... or check_target=true)")
    with tempfile.TemporaryDirectory(prefix="gguf-stage-") as stage:
        draft_dir, target_stub = Path(stage) / "draft", Path(stage) / "target"
        draft_dir.mkdir()
        ids = STAGERS[layout](pkg, draft_dir, opts)
        stage_target(Path(target_dir), target_stub)
        note(f"converting the {pkg.family.name} draft with llama.cpp's convert_hf_to_gguf.py")
        log = run_converter(draft_dir, target_stub, tmp / GGUF_FILE, OUTTYPES[opts.dtype], root)
    if layout == "eagle3" and converter_layers(log) != ids:
        raise ExportError(f"llama.cpp's converter wrote target layers {converter_layers(log)}, "
                          f"the head was trained on {ids} (its log: 'EAGLE-3: target_layers')")
    problems = gguf_problems(tmp / GGUF_FILE, expected_metadata(pkg, target_dir))
    if problems:
        raise ExportError("the converted GGUF differs from the package:\n  - "
                          + "\n  - ".join(problems))


# ----------------------------------------------------------------------------- checking
def expected_metadata(pkg: DraftPackage, target_dir: Any) -> dict[str, Any]:
    """What the draft's GGUF must say: architecture, target layers (llama.cpp's capture ids),
    the draft-to-target map (EAGLE-3 with a reduced vocabulary), block size and mask id
    (DFlash), and the target's tokens in id order."""
    from tokenizers import Tokenizer

    head, ident = pkg.head_config, pkg.info["target"]
    want: dict[str, Any] = {"arch": ARCH[pkg.family.gguf_layout],
                            "target_layers": sorted(head.fuse_layers)}
    d2t = pkg.family.draft_to_target(pkg.module, head)
    want["d2t"] = None if d2t is None else [int(x) for x in d2t]
    if getattr(head, "block_size", None) is not None:
        want.update(block_size=int(head.block_size), mask_token_id=int(head.mask_token_id))
    tok = Tokenizer.from_file(str(Path(target_dir) / "tokenizer.json"))
    want["tokens"] = [tok.id_to_token(i) for i in range(int(ident["vocab_size"]))]
    return want


def read_gguf(path: Path) -> dict[str, Any]:
    """The fields :func:`gguf_problems` compares, read with the ``gguf`` package."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items()
              if not k.startswith("tokenizer.ggml.merges")}
    arch = fields.get("general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    d2t = tensors.get("d2t")
    return {"arch": arch, "target_layers": fields.get(f"{arch}.target_layers"),
            "d2t": None if d2t is None else [int(x) for x in d2t.data.reshape(-1)],
            "block_size": fields.get(f"{arch}.block_size"),
            "mask_token_id": fields.get("tokenizer.ggml.mask_token_id"),
            "tokens": fields.get("tokenizer.ggml.tokens")}


def gguf_problems(path: Path, want: dict[str, Any]) -> list[str]:
    """Differences between a draft GGUF's metadata and ``want`` (empty: it matches)."""
    got = read_gguf(path)
    problems = []
    for key, value in want.items():
        have = got.get(key)
        if key == "tokens":
            if have != value:
                first = next((i for i, (a, b) in enumerate(zip(have or [], value)) if a != b),
                             min(len(have or []), len(value)))
                problems.append(f"tokens: {len(have or [])} in the GGUF, {len(value)} in the "
                                f"target's tokenizer, first difference at id {first}")
        elif key == "d2t" and have != value:
            n = sum(a != b for a, b in zip(have or [], value or []))
            problems.append(f"d2t: {'absent' if have is None else f'{len(have)} ids'} in the "
                            f"GGUF, {'none' if value is None else f'{len(value)} ids'} in the "
                            f"head ({n} differ)")
        elif have != value:
            problems.append(f"{key}: {have!r} in the GGUF, {value!r} expected")
    return problems
