"""Prepacked oneDNN matrix products for a target decoded on a CPU.

A decoding step multiplies a few rows (one token, or the K drafts and a tree's nodes) by every
weight matrix of the target. torch's default CPU path for ``F.linear`` hands these to MKL's
GEMM, which re-packs the whole weight on every call once more than one row is fed: on a 2-core
AVX2 CPU (Zen 3) a 2-row product over Qwen2.5-Coder-1.5B's 8960 x 1536 MLP weight costs 2.3x a
1-row one and its 151,936-row LM head 4 rows for 3.5x one. Verifying drafts then costs several
plain steps and no draft can pay. oneDNN's linear over a weight reordered once into its blocked
layout (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, the ops inductor's
weight prepacking uses) streams the weight once whatever the row count: on that CPU the whole
1.5B target then costs 263 / 294 / 323 / 375 / 590 ms for 1 / 2 / 4 / 8 / 16 fed tokens at a
300-token context, against 367 / 714 / 884 / 941 / 977 ms through transformers' own linears
(``bench/kernels/``).

:func:`apply_kernels` swaps a model's ``nn.Linear`` modules for :class:`PackedLinear` where that
measures faster here (``kernels=auto``: one MLP weight timed both ways at 1 and 8 rows, packed
where faster at both), always (``packed``), or never (``default``). Packing changes
floating-point rounding, not the model: plain decoding and verification use the same packed
target, so the decoder stays lossless (greedy identity is checked in fp32 by
``eval/exactness.py``). oneDNN packs fp32 on any
x86 CPU and bf16 only with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; elsewhere ``auto`` keeps the
default kernels and says why.
"""
from __future__ import annotations

import copy
import functools
import statistics
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("auto", "packed", "default")
HINT_ROWS = 16  # the row count oneDNN's reorder is tuned for: measured the best for 2-16 rows
PROBE_ROWS = (1, 8)  # `auto` times a plain step's and a verify forward's row counts


class PackedLinear(nn.Module):
    """``nn.Linear`` over a oneDNN-reordered copy of its weight (inference only).

    With ``keep_weight`` the original parameter stays (a weight tied to the embeddings: the
    packed copy is the only extra memory); otherwise it is released when nothing else holds it
    (:func:`apply_kernels`) and ``weight`` / ``state_dict()`` give it back from the packed copy
    (the same numbers), for code that reads a target's weights (a draft LM built from the
    target's layers, draft vocabularies cut from its LM head). ``.to()`` and ``copy.deepcopy``
    repack; where the new dtype or device cannot be packed the layer multiplies by the plain
    weight (``F.linear``).
    """

    def __init__(self, linear: nn.Linear, keep_weight: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        if keep_weight:
            self.weight = linear.weight
        self.packed = pack(linear.weight.detach())

    def __getattr__(self, name: str):
        packed = self.__dict__.get("packed")
        if name == "weight" and packed is not None and "weight" not in self._parameters:
            return packed.to_dense() if packed.layout == torch._mkldnn else packed
        return super().__getattr__(name)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if "weight" not in self._parameters:
            destination[prefix + "weight"] = self.weight

    def _apply(self, fn, recurse: bool = True):
        dense = None if "weight" in self._parameters else self.weight
        super()._apply(fn, recurse)
        dense = self._parameters["weight"] if dense is None else fn(dense)
        self.packed = pack(dense.detach())
        return self

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        new = PackedLinear.__new__(PackedLinear)
        nn.Module.__init__(new)
        memo[id(self)] = new
        new.in_features, new.out_features = self.in_features, self.out_features
        new.register_buffer("bias", copy.deepcopy(self.bias, memo))
        if "weight" in self._parameters:
            new.weight = copy.deepcopy(self._parameters["weight"], memo)
        new.packed = pack(self.weight.detach().clone())
        return new.train(self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        how = "oneDNN prepacked" if self.packed.layout == torch._mkldnn else "not packed"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {how}")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` reordered for oneDNN, or itself where its dtype or device cannot be packed."""
    if packing_unsupported(weight.dtype, weight.device) is not None:
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight, HINT_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over ``packed = pack(weight)`` (any leading dims)."""
    rows = x.reshape(-1, x.shape[-1])
    if packed.layout == torch._mkldnn:
        y = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    else:
        y = F.linear(rows, packed, bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def is_packed(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a oneDNN-reordered copy (:func:`pack` could pack it here)."""
    return weight.layout == torch._mkldnn


def _one_of(key: str, value: object, choices: tuple[str, ...], allowed: str) -> str:
    """``value`` lower-cased, refused (naming ``allowed``) unless one of ``choices``."""
    text = str(value).lower()
    if text not in choices:
        raise ValueError(f"{key}={value!r}: allowed {allowed}")
    return text


def check_kernels(value: object) -> str:
    """``kernels`` as one of :data:`KERNELS`."""
    return _one_of("kernels", value, KERNELS, "auto (oneDNN prepacked linears where measured "
                   "faster here), packed (always) or default (torch's own)")


@functools.lru_cache(maxsize=16)
def packing_unsupported(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why oneDNN cannot pack a ``dtype`` linear on ``device`` here (None: it can)."""
    if device.type != "cpu":
        return f"device {device.type}: prepacked kernels are for CPUs"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), HINT_ROWS)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 16, dtype=dtype), w, None, "none",
                                           [], "")
    except RuntimeError as err:
        return f"oneDNN cannot pack {dtype} on this CPU ({str(err).splitlines()[0]})"
    return None


def _linears(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Linear]]:
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear:  # subclasses (LoRA, quantized) keep their own forward
                yield parent, name, child


def _median_ms(fn, repeats: int = 5, min_s: float = 0.02, most: int = 200) -> float:
    """Median milliseconds of ``fn`` over at least ``repeats`` calls and ``min_s`` seconds (at
    most ``most`` calls): a product of microseconds is timed often enough that one stall of a
    loaded machine does not decide."""
    fn()
    times: list[float] = []
    while len(times) < repeats or (sum(times) < min_s and len(times) < most):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def probe(linear: nn.Linear) -> dict[str, list[float]]:
    """Milliseconds of ``linear`` at :data:`PROBE_ROWS` rows: ``default`` and ``packed``."""
    packed = PackedLinear(linear, keep_weight=True)
    out: dict[str, list[float]] = {"rows": list(PROBE_ROWS), "default": [], "packed": []}
    for rows in PROBE_ROWS:
        x = torch.randn(rows, linear.in_features, dtype=linear.weight.dtype)
        out["default"].append(round(_median_ms(
            lambda x=x: F.linear(x, linear.weight, linear.bias)), 3))
        out["packed"].append(round(_median_ms(lambda x=x: packed(x)), 3))
    return out


def apply_kernels(model: nn.Module, kernels: str = "auto",
                  shared: tuple[torch.Tensor, ...] = ()) -> tuple[str, str]:
    """Pack ``model``'s linears as ``kernels`` says; returns ``(used, why)``, ``used`` one of
    ``packed`` / ``default``. Call after the model has its final device and dtype. Linears
    whose weight shares storage with one of ``shared`` (a head's LM head that is the target's
    own) stay as they are: a packed copy would double that memory."""
    kernels = check_kernels(kernels)
    owned = {w.untyped_storage().data_ptr() for w in shared}
    layers = [(parent, name, linear) for parent, name, linear in _linears(model)
              if linear.weight.untyped_storage().data_ptr() not in owned]
    if kernels == "default" or not layers:
        return "default", "kernels=default" if layers else "no nn.Linear modules"
    param = next(model.parameters())
    why_not = packing_unsupported(param.dtype, param.device)
    if why_not:
        if kernels == "packed":
            raise ValueError(f"kernels=packed: {why_not}; use kernels=auto or default")
        return "default", why_not
    why = "kernels=packed"
    if kernels == "auto":
        largest = max((lin for _, _, lin in layers if lin.out_features < 65536),
                      key=lambda lin: lin.weight.numel(), default=layers[0][2])
        times = probe(largest)
        shown = ", ".join(f"{r} rows {d:.2f} -> {p:.2f} ms" for r, d, p in
                          zip(times["rows"], times["default"], times["packed"]))
        why = f"{tuple(largest.weight.shape)} weight: {shown}"
        if any(p >= d for p, d in zip(times["packed"], times["default"])):
            return "default", f"prepacked not faster here at every width ({why})"
    # the LM head keeps its weight beside the packed copy: it is read (draft vocabularies cut
    # rows of it) and often tied to the embeddings, whose matrix stays anyway
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    for parent, name, linear in layers:
        setattr(parent, name, PackedLinear(linear, keep_weight=linear is output))
    return "packed", why


def kernels_in(model: nn.Module) -> str:
    """``packed`` if any of ``model``'s linears are :class:`PackedLinear`, else ``default``."""
    return "packed" if any(isinstance(m, PackedLinear) for m in model.modules()) else "default"


@torch.inference_mode()
def int8_or_dense(module: nn.Module, kernels: str = "auto") -> tuple[str, str]:
    """Keep a weight-only int8 draft's int8 layers, or multiply by their dequantized weights,
    whichever is faster here (``kernels=default``: keep them); returns ``(used, why)``, ``used``
    one of ``int8`` / ``dense`` / ``none`` (no int8 layer).

    torch's int8 weight-only kernel (``torch._weight_int8pack_mm``) is fast where the CPU has
    AVX-512 or AMX, but on a 2-core AVX2 CPU it runs one matrix-vector product per row: a
    16,384 x 1,536 weight costs 13 ms for one row and 415 ms for 32 (a head catching up on 32
    positions after plain steps), against 5 and 32 ms dense in fp32. The dequantized weights are
    the numbers the int8 layer multiplies by, so the draft stays the same draft."""
    from draftsmith.heads.quantize import Int8Linear, dequantize

    layers = [m for m in module.modules() if isinstance(m, Int8Linear)]
    if not layers:
        return "none", "no int8 layers"
    if check_kernels(kernels) == "default":
        return "int8", "kernels=default"
    largest = max(layers, key=lambda m: m.weight_int8.numel())
    dense = largest.weight
    rows_ms = {"int8": [], "dense": []}
    for rows in PROBE_ROWS:
        x = torch.randn(rows, largest.in_features, dtype=largest.scales.dtype)
        rows_ms["int8"].append(_median_ms(lambda x=x: largest(x)))
        rows_ms["dense"].append(_median_ms(lambda x=x: F.linear(x, dense)))
    shown = ", ".join(f"{r} rows {i:.2f} -> {d:.2f} ms" for r, i, d in
                      zip(PROBE_ROWS, rows_ms["int8"], rows_ms["dense"]))
    why = f"{tuple(dense.shape)} int8 weight against dense: {shown}"
    if sum(rows_ms["dense"]) >= sum(rows_ms["int8"]):
        return "int8", why
    dequantize(module)
    return "dense", why


DRAFT_KERNELS = ("auto", "default")


def check_draft_kernels(value: object) -> str:
    """``draft_kernels`` as one of :data:`DRAFT_KERNELS`."""
    return _one_of("draft_kernels", value, DRAFT_KERNELS, "auto (the draft's linears "
                   "prepacked where the target's are) or default (torch's own)")


def pack_draft(module: nn.Module, target: nn.Module, draft_kernels: str = "auto",
               shares_target: bool = True) -> None:
    """Pack a draft's own linears (``draft_kernels=auto``) where ``target``'s are packed: its
    matmuls are the target's kind, a few rows each, and a head multiplies its weights once per
    drafted depth. With ``shares_target`` (a head reading the target's embedding and LM head)
    the weights it shares with ``target`` are read as they are."""
    if check_draft_kernels(draft_kernels) != "auto" or kernels_in(target) != "packed":
        return
    shared = () if not shares_target else tuple(
        m.weight for m in (target.get_input_embeddings(), target.get_output_embeddings())
        if m is not None)
    apply_kernels(module, "auto", shared)
