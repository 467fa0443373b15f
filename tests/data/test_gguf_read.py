"""data/gguf_read.py: transformers parses a GGUF once per conversion, not once per call."""
from __future__ import annotations

import gguf
import pytest

from draftsmith.data.gguf_read import one_parse_per_file


@pytest.fixture
def counted(monkeypatch) -> list[str]:
    """Every real ``gguf.GGUFReader`` parse, by path."""
    real, parses = gguf.GGUFReader, []

    def reader(path, mode="r"):
        parses.append(str(path))
        return real(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", reader)
    return parses


@pytest.mark.real
def test_transformers_parses_the_gguf_once_inside_and_every_call_outside(counted):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from draftsmith.data.packaged import default_cache_root, packaged_target

    path = packaged_target("smollm2_135m").gguf_file(default_cache_root())
    with one_parse_per_file() as readers:
        first = load_gguf_checkpoint(path)
        second = load_gguf_checkpoint(path)  # transformers' config, then its tokenizer
    assert len(counted) == 1 and len(readers) == 1
    assert first["config"] == second["config"] and first["tokenizer"] == second["tokenizer"]
    assert counted == [str(path)]
    # twin: outside the block every call parses the file again, with the same result
    again = load_gguf_checkpoint(path)
    assert len(counted) == 2 and again["config"] == first["config"]
