"""INT8 and INT4 drafts for CPU decoding.

Three schemes, all torch's own kernels (no extra dependency):

* ``int8`` (the default): **weight-only** int8. Each ``Linear``'s weights are stored as int8,
  symmetric per output channel; activations stay in the decoding dtype and the matmul is
  ``torch._weight_int8pack_mm`` (the CPU weight-only int8 kernel torchao's int8 weight-only
  path also uses), which reads a quarter of fp32's and half of bf16's weight bytes: on this
  CPU an 8,192 x 576 LM head GEMV takes 113 us in bf16 activations against 222 us dense bf16.
* ``int8_dynamic``: torch's dynamic int8 ``Linear`` (activations quantized per call, per
  tensor, from fp32; fbgemm / x86 kernels). Measured unusable for EAGLE heads: the fused target
  features and the head's normed output carry outlier channels, and per-tensor activation
  scales wipe out the rest (top-1 agreement with the float head 0.3% over MT-bench prompts,
  14% with the LM head alone quantized). Kept, labelled, for drafts without such outliers.

* ``int4``: **weight-only** int4, asymmetric per group of 32 input channels (a scale and a
  zero point per group), matmul by ``torch._weight_int4pack_mm_for_cpu`` (the CPU kernel behind
  torchao's int4 weight-only path; torchao itself is not needed for it). It reads half of int8's
  weight bytes; the group scales keep its error near int8's per-channel one. Where torch cannot
  pack int4 weights on the CPU at hand the layer multiplies by its dequantized weights (same
  numbers, no speed-up) and says so in ``Int4Linear.kernel``.

A quantized package is the trained package plus ``"quantization"`` in ``draftsmith.json``
(scheme and modules); its weights file is the trained one and the int8 weights are made from
it at load (deterministic: every load drafts the same).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

SCHEMES = ("int8", "int8_dynamic", "int4")
WEIGHT_ONLY = ("int8", "int4")  # int8 / int4 weights, float activations: dequantizable
FP32_ONLY = ("int8_dynamic",)  # schemes whose kernels take float32 inputs only


def int8_weights(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Weight-only int8 of a Linear's ``(out, in)`` weight: int8 values and float32 scales,
    symmetric per output channel (each channel's largest magnitude maps to 127)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


class Int8Linear(nn.Module):
    """A ``Linear`` with int8 weights (symmetric per output channel) and float activations.

    ``weight`` gives the dequantized weights (for code that reads a Linear's weight)."""

    def __init__(self, linear: nn.Linear, stored: tuple[Tensor, Tensor] | None = None) -> None:
        super().__init__()
        q, scales = stored if stored is not None else int8_weights(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if tuple(q.shape) != (self.out_features, self.in_features):
            raise ValueError(f"stored int8 weights {tuple(q.shape)} do not fit a Linear of "
                             f"{(self.out_features, self.in_features)}")
        # a fresh (aligned) copy: the int8 kernel reads it with aligned vector loads, and a tensor
        # straight from a safetensors file may sit at any offset
        self.register_buffer("weight_int8",
                             q.to(torch.int8).clone(memory_format=torch.contiguous_format))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    @property
    def weight(self) -> Tensor:
        return self.weight_int8.to(self.scales.dtype) * self.scales[:, None]

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features)
        y = torch._weight_int8pack_mm(flat, self.weight_int8, self.scales.to(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """A ``Linear`` with int4 weights (asymmetric per group of ``group`` input channels:
    ``w = (q - 8) * scale + zero``, ``q`` in 0..15) and float activations.

    ``weight`` gives the dequantized weights."""

    def __init__(self, linear: nn.Linear, group: int = 32) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        if k % group:
            raise ValueError(f"int4 needs input features divisible by the group size {group}; "
                             f"this Linear has {k}: leave it out of the quantized modules")
        self.in_features, self.out_features, self.group = k, n, group
        wg = w.view(n, k // group, group)
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).view(n, k)
        self.register_buffer("weight_int4", q.to(torch.uint8))  # one value per byte, unpacked
        # (k / group, n, 2): the kernel's layout of scales and zero points
        self.register_buffer("scales_and_zeros", torch.stack([scale, lo + 8 * scale], -1)
                             .transpose(0, 1).contiguous().to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        try:  # the packed layout is the kernel's own, made on the machine that runs it
            self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            self.kernel = "int4pack"
        except (RuntimeError, AttributeError, NotImplementedError) as e:
            self.packed, self.kernel = None, f"dense dequantized ({type(e).__name__}: {e})"[:200]

    @property
    def weight(self) -> Tensor:
        n, k, g = self.out_features, self.in_features, self.group
        sz = self.scales_and_zeros.float().transpose(0, 1)  # (n, k / g, 2)
        q = self.weight_int4.float().view(n, k // g, g)
        w = (q - 8) * sz[..., :1] + sz[..., 1:]
        return w.view(n, k).to(self.scales_and_zeros.dtype)

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is None or x.device.type != "cpu":
            return nn.functional.linear(x, self.weight.to(x.dtype),
                                        None if self.bias is None else self.bias.to(x.dtype))
        flat = x.reshape(-1, self.in_features)
        y = torch._weight_int4pack_mm_for_cpu(flat, self.packed, self.group,
                                              self.scales_and_zeros.to(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


def quantizable(module: nn.Module, skip: tuple[str, ...] = ()) -> list[str]:
    """Names of the ``nn.Linear`` modules to quantize (all but those in ``skip``: the draft LM's
    LM head, whose rows a draft vocabulary cuts out)."""
    return [name for name, m in module.named_modules()
            if isinstance(m, nn.Linear) and name.split(".")[-1] not in skip]


def quantize(module: nn.Module, scheme: str, names: list[str],
             stored: dict[str, tuple[Tensor, Tensor]] | None = None) -> nn.Module:
    """Replace the ``nn.Linear`` modules ``names`` of ``module`` by int8 / int4 ones, in place
    (``int8_dynamic`` also turns the module float32); returns ``module``. ``stored``: int8
    values and scales a package stored per module (``heads.weights.stored_int8``), used as they
    are instead of quantizing the module's weights again.

    Raises:
        ValueError: an unknown scheme, or a name that is not a Linear of this module.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"quantization scheme {scheme!r}: allowed {SCHEMES}")
    linears = {n for n, m in module.named_modules() if isinstance(m, nn.Linear)}
    bad = sorted(set(names) - linears)
    if bad:
        raise ValueError(f"quantization lists modules that are not Linear layers of this draft: "
                         f"{bad[:5]}; the package was quantized from another draft")
    if scheme == "int8_dynamic":
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        module.float()
        quantize_dynamic(module, {n: per_channel_dynamic_qconfig for n in names}, inplace=True)
        return module
    stored = stored or {}
    if stored and scheme != "int8":
        raise ValueError(f"stored int8 weights in a {scheme} package")
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = module.get_submodule(parent) if parent else module
        linear = getattr(owner, leaf)
        setattr(owner, leaf, Int4Linear(linear) if scheme == "int4"
                else Int8Linear(linear, stored.get(name)))
    return module


def dequantize(module: nn.Module) -> nn.Module:
    """Replace every weight-only int8 / int4 layer of ``module`` by an ``nn.Linear`` holding its
    dequantized weights (the weights the layer multiplies by), in place; returns ``module``.
    What a float layout (an engine's export) can carry of a quantized copy."""
    for name, m in list(module.named_modules()):
        if not isinstance(m, (Int8Linear, Int4Linear)):
            continue
        w = m.weight.detach()
        linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None,
                           device=w.device, dtype=w.dtype)
        with torch.no_grad():
            linear.weight.copy_(w)
            if m.bias is not None:
                linear.bias.copy_(m.bias)
        parent, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, leaf, linear)
    return module


def record(module: nn.Module, scheme: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ``draftsmith.json["quantization"]`` entry for quantizing ``module``."""
    weight_only = scheme != "int8_dynamic"
    return {"scheme": scheme, "modules": quantizable(module, skip),
            "weights": ("int4, asymmetric per group of 32 input channels" if scheme == "int4"
                        else "int8, symmetric per output channel"),
            "activations": ("the decoding dtype (weight-only)" if weight_only
                            else "float32, quantized per call (dynamic)")}
