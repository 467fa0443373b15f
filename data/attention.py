"""A switch for transformers' SDPA attention on grouped-query models (verification forwards)."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

FORCE_GQA_ENV = "TRANSFORMERS_SDPA_FORCE_GQA"


@contextlib.contextmanager
def native_gqa(enabled: bool = True) -> Iterator[None]:
    """Let transformers' SDPA attention use torch's native grouped-query attention for this call.

    For a multi-token forward with a mask (every verify forward: a cache is present), transformers'
    SDPA path copies each layer's whole key/value cache to repeat the KV heads (``repeat_kv``),
    because on CUDA a masked GQA call falls back to the math kernel. On CPU the masked
    ``enable_gqa=True`` call is fine, and skipping the copy makes verification cheaper the longer
    the context (the outputs are the same). transformers reads
    ``TRANSFORMERS_SDPA_FORCE_GQA`` per call; this sets it for the duration of the block only,
    so nothing else in the process (transformers' own ``generate`` included) is affected.
    """
    if not enabled:
        yield
        return
    old = os.environ.get(FORCE_GQA_ENV)
    os.environ[FORCE_GQA_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ[FORCE_GQA_ENV]
        else:
            os.environ[FORCE_GQA_ENV] = old
