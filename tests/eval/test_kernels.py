"""oneDNN prepacked linears for the target (eval/decoding/kernels.py, kernels=)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.eval import decode
from draftsmith.eval.decoding.kernels import (
    PackedLinear,
    apply_kernels,
    check_kernels,
    kernels_in,
    packing_unsupported,
)
from draftsmith.eval.machine import environment
from draftsmith.eval.retime import measured_here
from tests.conftest import draft_package, tiny_llama

needs_fp32_packing = pytest.mark.skipif(
    packing_unsupported(torch.float32, torch.device("cpu")) is not None,
    reason="this torch build or CPU cannot prepack fp32 linears")


@needs_fp32_packing
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_computes_the_linear(bias):
    torch.manual_seed(0)
    lin = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(lin, keep_weight=False)
    assert torch.equal(packed.weight, lin.weight) and "prepacked" in repr(packed)
    assert set(packed.state_dict()) == ({"weight", "bias"} if bias else {"weight"})
    for shape in [(1, 48), (3, 48), (16, 48), (2, 5, 48)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias),
                                   rtol=1e-5, atol=1e-5)


def _tiny_with_logits(seed: int = 3):
    """A tiny Llama, a prompt and the model's logits on it before any packing."""
    model = tiny_llama(seed=seed)
    ids = torch.randint(3, 96, (1, 12))
    with torch.inference_mode():
        return model, ids, model(ids).logits


@needs_fp32_packing
def test_packing_a_model_keeps_its_outputs_and_shared_weights():
    model, ids, before = _tiny_with_logits()
    used, why = apply_kernels(model, "packed")
    assert (used, why) == ("packed", "kernels=packed") and kernels_in(model) == "packed"
    assert not any(type(m) is nn.Linear for m in model.modules())
    # the tied LM head still reads the embedding matrix (draft vocabularies cut rows of it)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    up = model.model.layers[0].mlp.up_proj
    assert "weight" not in dict(up.named_parameters())  # an untied original is released...
    fresh = tiny_llama(seed=3)
    torch.testing.assert_close(up.weight, fresh.model.layers[0].mlp.up_proj.weight)  # ...not lost
    with torch.inference_mode():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    # its state_dict is the unpacked model's: a draft LM can be built from its layers
    other = tiny_llama(seed=9)
    other.load_state_dict(model.state_dict())
    with torch.inference_mode():
        torch.testing.assert_close(other(ids).logits, before, rtol=1e-5, atol=1e-5)
    assert apply_kernels(model, "packed")[0] == "default"  # nothing left to pack


@needs_fp32_packing
def test_a_wrongly_packed_weight_is_caught():
    """The twin of the test above: packing another matrix changes the outputs it compares."""
    model, ids, before = _tiny_with_logits()
    apply_kernels(model, "packed")
    mlp = model.model.layers[0].mlp
    wrong = nn.Linear(mlp.up_proj.in_features, mlp.up_proj.out_features, bias=False)
    mlp.up_proj = PackedLinear(wrong, keep_weight=False)
    with torch.inference_mode():
        after = model(ids).logits
    assert not torch.allclose(after, before, rtol=1e-4, atol=1e-4)


def test_default_and_bad_values():
    model = tiny_llama(seed=1)
    assert apply_kernels(model, "default") == ("default", "kernels=default")
    assert kernels_in(model) == "default"
    assert check_kernels("AUTO") == "auto"
    with pytest.raises(ValueError, match="kernels='fast'.*auto.*packed.*default"):
        check_kernels("fast")
    assert "CPUs" in packing_unsupported(torch.float32, torch.device("cuda"))


def test_auto_says_what_it_measured():
    model = tiny_llama(seed=1, hidden=64)
    used, why = apply_kernels(model, "auto")
    assert used in ("packed", "default") and kernels_in(model) == used
    if packing_unsupported(torch.float32, torch.device("cpu")) is None:
        assert "(128, 64) weight: 1 rows" in why and "8 rows" in why


def test_packed_is_refused_where_oneDNN_cannot_pack(monkeypatch):
    from draftsmith.eval.decoding import kernels

    monkeypatch.setattr(kernels, "packing_unsupported", lambda dtype, device: "no oneDNN here")
    model = tiny_llama(seed=1)
    with pytest.raises(ValueError, match="kernels=packed: no oneDNN here; use kernels=auto"):
        apply_kernels(model, "packed")
    assert apply_kernels(model, "auto") == ("default", "no oneDNN here")


def test_a_record_of_other_kernels_is_not_measured_here():
    here = environment("cpu")["hardware"]
    rec = {"dtype": "float32", "hardware": dict(here)}  # older records: default kernels
    assert measured_here(rec, "float32", "cpu", "default")
    assert not measured_here(rec, "float32", "cpu", "packed")
    assert measured_here({**rec, "kernels": "packed"}, "float32", "cpu", "packed")


@needs_fp32_packing
@pytest.mark.parametrize("kind", ["eagle", "lm"])
def test_decoding_a_packed_target_is_lossless(decode_setup, kind):
    pkg, _ = draft_package(decode_setup, kind)
    summary = decode.run_overrides([f"draft={pkg}", f"target_path={decode_setup['target']}",
                                    f"prompts={decode_setup['questions']}", "max_new_tokens=12",
                                    "temperature=0", "limit=2", "kernels=packed", "k=3"])["summary"]
    assert summary["kernels"] == "packed"
    assert summary["matches_baseline"] == 1.0  # greedy: token-identical to plain decoding
    with pytest.raises(ValueError, match="kernels="):
        decode.run_overrides([f"draft={pkg}", f"target_path={decode_setup['target']}",
                              f"prompts={decode_setup['questions']}", "kernels=fastest"])


def _timings(monkeypatch, int8_ms: float, dense_ms: float) -> None:
    """Fake probe timings: int8_or_dense times the int8 layer, then the dense product."""
    from draftsmith.eval.decoding import kernels

    calls = iter([int8_ms, dense_ms] * len(kernels.PROBE_ROWS))
    monkeypatch.setattr(kernels, "_median_ms", lambda fn: (fn(), next(calls))[1])


def test_an_int8_draft_is_kept_or_multiplied_by_its_dequantized_weights(monkeypatch):
    from draftsmith.eval.decoding.kernels import int8_or_dense
    from draftsmith.heads.quantize import Int8Linear

    torch.manual_seed(0)
    x = torch.randn(5, 64)

    def draft():
        torch.manual_seed(0)
        return nn.Sequential(Int8Linear(nn.Linear(64, 96)), nn.ReLU(), nn.Linear(96, 8))

    module = draft()
    with torch.inference_mode():
        before = module(x)
    assert int8_or_dense(module, "default") == ("int8", "kernels=default")
    assert int8_or_dense(nn.Linear(4, 4)) == ("none", "no int8 layers")
    _timings(monkeypatch, int8_ms=1.0, dense_ms=2.0)  # int8 faster here: kept
    used, why = int8_or_dense(module, "auto")
    assert used == "int8" and "(96, 64) int8 weight against dense: 1 rows 1.00 -> 2.00" in why
    assert isinstance(module[0], Int8Linear)
    _timings(monkeypatch, int8_ms=2.0, dense_ms=1.0)  # dense faster: the same numbers, dense
    assert int8_or_dense(module, "auto")[0] == "dense"
    assert type(module[0]) is nn.Linear
    with torch.inference_mode():
        torch.testing.assert_close(module(x), before, rtol=1e-5, atol=1e-5)


@needs_fp32_packing
def test_a_packed_model_copies_and_moves_like_any_model():
    import copy

    model = tiny_llama(seed=4)
    ids = torch.randint(3, 96, (1, 10))
    apply_kernels(model, "packed")
    with torch.inference_mode():
        before = model(ids).logits
        twin = copy.deepcopy(model)
        assert twin.get_output_embeddings().weight is twin.get_input_embeddings().weight
        assert twin.get_output_embeddings().weight is not model.get_input_embeddings().weight
        torch.testing.assert_close(twin(ids).logits, before, rtol=1e-5, atol=1e-5)
        low = copy.deepcopy(model).to(torch.bfloat16)  # repacked, or plain where bf16 cannot be
        up = low.model.layers[0].mlp.up_proj
        assert up.weight.dtype == torch.bfloat16
        assert ("not packed" in repr(up)) == (
            packing_unsupported(torch.bfloat16, torch.device("cpu")) is not None)
        torch.testing.assert_close(low(ids).logits.float(), before, rtol=0.1, atol=0.1)
