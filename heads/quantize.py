"""INT8 drafts for CPU decoding.

Two schemes, both torch's own kernels (no extra dependency):

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

INT4 is not offered: torch's int4 weight-only CPU kernel needs AMX-era packing this CPU class
lacks, and torchao's int4 schemes target GPUs.

A quantized package is the trained package plus ``"quantization"`` in ``draftsmith.json``
(scheme and modules); its weights file is the trained one and the int8 weights are made from
it at load (deterministic: every load drafts the same).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

SCHEMES = ("int8", "int8_dynamic")
FP32_ONLY = ("int8_dynamic",)  # schemes whose kernels take float32 inputs only


class Int8Linear(nn.Module):
    """A ``Linear`` with int8 weights (symmetric per output channel) and float activations.

    ``weight`` gives the dequantized weights (for code that reads a Linear's weight)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", torch.round(w / scales[:, None]).clamp(-127, 127)
                             .to(torch.int8).contiguous())
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


def quantizable(module: nn.Module, skip: tuple[str, ...] = ()) -> list[str]:
    """Names of the ``nn.Linear`` modules to quantize (all but those in ``skip``: the draft LM's
    LM head, whose rows a draft vocabulary cuts out)."""
    return [name for name, m in module.named_modules()
            if isinstance(m, nn.Linear) and name.split(".")[-1] not in skip]


def quantize(module: nn.Module, scheme: str, names: list[str]) -> nn.Module:
    """Replace the ``nn.Linear`` modules ``names`` of ``module`` by int8 ones, in place
    (``int8_dynamic`` also turns the module float32); returns ``module``.

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
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = module.get_submodule(parent) if parent else module
        setattr(owner, leaf, Int8Linear(getattr(owner, leaf)))
    return module


def record(module: nn.Module, scheme: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ``draftsmith.json["quantization"]`` entry for quantizing ``module``."""
    weight_only = scheme == "int8"
    return {"scheme": scheme, "modules": quantizable(module, skip),
            "weights": "int8, symmetric per output channel",
            "activations": ("the decoding dtype (weight-only)" if weight_only
                            else "float32, quantized per call (dynamic)")}
