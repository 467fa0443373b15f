"""``format=gguf``: a draft LM as a llama.cpp GGUF file (``draft.gguf``), with the ``gguf`` package.

llama.cpp runs it as the draft model beside the target's GGUF (``llama-speculative -md``,
``llama-server --model-draft``, or llama-cpp-python with a draft model: ``scripts/engines.py``).
What the file holds, and why:

* architecture ``llama`` hyper-parameters from the draft's config (``llama.*`` keys);
* tensors named by gguf's own HF -> GGUF name map (``gguf.get_tensor_name_map``); ``attn_q`` and
  ``attn_k`` rows permuted per head from transformers' rotate-half RoPE layout to llama.cpp's
  adjacent-pair layout (the inverse of what transformers' GGUF loader undoes); norms in float32,
  matrices in the export dtype (float32 or float16); no ``output.weight`` for tied embeddings;
* the tokenizer (``tokenizer.*`` keys) copied from the target's own GGUF, so llama.cpp sees the
  draft and the target with one vocabulary. The default source is the GGUF of the packaged
  target with the draft's target digest (conf/target/*.yaml); pass ``gguf_vocab_from`` for
  another target.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

GGUF_FILE = "draft.gguf"
DTYPES = {torch.float32: ("F32", 0), torch.float16: ("F16", 1)}  # name, llama.cpp file type


def _permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a q/k projection, per head, from rotate-half order to adjacent pairs."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def vocab_source(identity: dict, given: str | Path | None) -> Path:
    """The GGUF whose tokenizer the draft's GGUF copies (see the module docstring).

    Raises:
        ValueError: none given and the draft's target is not a packaged one.
    """
    if given is not None:
        path = Path(given)
        if not path.is_file():
            raise ValueError(f"gguf_vocab_from={given} is not a file: pass the target's GGUF")
        return path
    from draftsmith.data.identity import TargetNotFoundError
    from draftsmith.data.packaged import target_gguf

    try:  # the packaged target this draft was made for, found by its pinned digest
        return target_gguf(identity["weights_sha256"])
    except TargetNotFoundError as e:
        raise ValueError(f"format=gguf copies the tokenizer from the target's GGUF, and the "
                         f"draft's target {identity['name']} is not a packaged one ({e}): pass "
                         "gguf_vocab_from=<the target's .gguf>") from e


def write_gguf(model: Any, path: Path, dtype: torch.dtype, vocab_from: Path | None,
               name: str) -> None:
    """Write a transformers ``LlamaForCausalLM`` as a llama.cpp GGUF file.

    Args:
        model: the draft LM.
        path: the ``.gguf`` file to write.
        dtype: float32 or float16 for the matrices (norms stay float32).
        vocab_from: a GGUF whose ``tokenizer.*`` keys are copied (None: no tokenizer, for
            loaders that take it elsewhere, e.g. transformers in tests).
        name: ``general.name``.
    """
    import gguf

    if dtype not in DTYPES:
        raise ValueError(f"format=gguf writes float32 or float16 weights, not {dtype}: pass "
                         "dtype=float32 or dtype=float16")
    cfg = model.config
    if getattr(cfg, "model_type", None) != "llama":
        raise ValueError(f"format=gguf writes the llama architecture; this draft is "
                         f"{cfg.model_type!r}")
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    if rope.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"format=gguf: rope_type {rope['rope_type']!r} is not written")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(DTYPES[dtype][1])
    if vocab_from is not None:
        reader = gguf.GGUFReader(str(vocab_from))
        for key, field in reader.fields.items():
            if key.startswith("tokenizer."):
                sub = field.types[1] if len(field.types) > 1 else None
                w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for key, t in model.state_dict().items():
        if tied and key == "lm_head.weight":
            continue
        out = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if out is None:
            raise ValueError(f"format=gguf: no GGUF name for tensor {key!r}")
        t = t.detach().float().cpu()
        if key.endswith("q_proj.weight"):
            t = _permute_rope(t, n_head)
        elif key.endswith("k_proj.weight"):
            t = _permute_rope(t, n_kv)
        w.add_tensor(out, t.numpy() if t.dim() == 1 else t.to(dtype).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
