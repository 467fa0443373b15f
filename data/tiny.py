"""Tiny random targets that share the real target's tokenizer (``debug=tiny``, tests).

A tiny Llama with the real tokenizer runs the whole pipeline (ShareGPT through the chat template,
feature cache, every draft family, the decoder) in seconds. It is for checking logic only: its
distributions are random, so its accept rates mean nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_target_dir(hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                    num_kv_heads: int = 2, seed: int = 0, initializer_range: float = 0.02,
                    base: str | None = None,
                    cache_dir: str | Path | None = None) -> Path:
    """Create (once) and return a folder holding a tiny random Llama with the base target's
    tokenizer.

    Args:
        hidden_size, num_layers, num_heads, num_kv_heads: the tiny model's shape.
        seed: weight initialisation seed (a different seed is a different target).
        initializer_range: std of the random weights (larger = peakier next-token distributions).
        base: the target whose tokenizer is reused (a ``load_target`` path: None = the packaged
            SmolLM2, ``pkg:gemma3_270m``, a folder, ...); saved with its own chat template (none
            for a base model, which loading the tiny target then gives the plain format).
        cache_dir: where targets are cached (default: the target cache).
    """
    from draftsmith.data.packaged import default_cache_root
    from draftsmith.data.target import load_target

    base_target = load_target(base)
    vocab = base_target.model.config.vocab_size
    spec = {"hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
            "num_kv_heads": num_kv_heads, "seed": seed, "vocab": vocab, "init": initializer_range,
            "tokenizer": base_target.identity.tokenizer_sha256}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir else default_cache_root()
    out = root / f"tiny-{key}"
    if (out / "config.json").is_file():
        return out
    tok = base_target.tokenizer
    if base_target.chat_format != "tokenizer":  # the tokenizer as its files define it
        tok.chat_template = None
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         max_position_embeddings=2048,
                         tie_word_embeddings=True, rope_theta=10000.0,
                         initializer_range=initializer_range,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(out) if not out.exists() else shutil.rmtree(tmp)
    return out


def target_path_from_config(target_cfg) -> str | None:
    """The ``path`` to pass to ``load_target`` for a ``conf/target`` node (handles ``tiny:``;
    ``pkg:<key>`` and the other path forms are passed on as they are). Its chat format is
    ``target_cfg.get("chat_template")``, the ``chat_template`` keyword of ``load_target``."""
    tiny = target_cfg.get("tiny") if hasattr(target_cfg, "get") else None
    if tiny:
        return str(tiny_target_dir(**dict(tiny)))
    return target_cfg.get("path")
