"""Read a GGUF file's metadata once per conversion.

transformers parses a GGUF anew in every ``from_pretrained`` that takes it (the config, the
model, the tokenizer: three times per conversion), and the parse walks every metadata entry in
Python: for Gemma 3's 262,144-word vocabulary about 17 s each (~50 s of a ~90 s conversion).
Inside :func:`one_parse_per_file` the parsed reader is kept and handed out again; it only reads
the file (a memory map), so a second user sees exactly what a fresh parse would give.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def one_parse_per_file() -> Iterator[dict[str, Any]]:
    """Within the block, ``gguf.GGUFReader(path)`` parses each file once (transformers imports
    the name at call time, so it finds this one). Yields the readers by resolved path."""
    import gguf

    real = gguf.GGUFReader
    readers: dict[str, Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = f"{Path(path).resolve()}:{mode}"
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield readers
    finally:
        gguf.GGUFReader = real
