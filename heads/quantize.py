"""INT8 drafts for CPU decoding: torch's dynamic int8 ``Linear``.

Weights are quantized once, symmetric per output channel (int8); activations are quantized per
call from float32, and the matmul runs in torch's fbgemm / x86 int8 kernels. It is torch's own
machinery (no extra dependency), it runs on any x86 CPU, and on a draft the size of these
heads it is what the CPU has fast int8 kernels for; torchao's int8 / int4 weight-only schemes
target GPUs and recent Intel CPUs' AMX path. INT4 is not offered: nothing torch ships runs int4
matmuls on a CPU without AMX.

A quantized package is the trained package plus ``"quantization"`` in ``draftsmith.json``
(scheme and the quantized modules); its weights file is the trained one, and the int8 weights
are made from it at load time (deterministic, so every load drafts the same). The rest of the
draft (norms, embeddings, modules left out) runs in float32, which dynamic int8 needs for its
inputs: a quantized draft is always float32 outside its int8 matmuls.
"""
from __future__ import annotations

from typing import Any

from torch import nn

SCHEMES = ("int8",)


def quantizable(module: nn.Module, skip: tuple[str, ...] = ()) -> list[str]:
    """Names of the ``nn.Linear`` modules to quantize (all but those in ``skip``: the draft LM's
    LM head, whose rows a draft vocabulary cuts out)."""
    return [name for name, m in module.named_modules()
            if isinstance(m, nn.Linear) and name.split(".")[-1] not in skip]


def quantize(module: nn.Module, scheme: str, names: list[str]) -> nn.Module:
    """Replace the ``nn.Linear`` modules ``names`` of ``module`` (float32 first) by dynamic
    int8 ones, in place; returns ``module``.

    Raises:
        ValueError: an unknown scheme, or a name that is not a Linear of this module.
    """
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    if scheme not in SCHEMES:
        raise ValueError(f"quantization scheme {scheme!r}: allowed {SCHEMES}")
    linears = {n for n, m in module.named_modules() if isinstance(m, nn.Linear)}
    bad = sorted(set(names) - linears)
    if bad:
        raise ValueError(f"quantization lists modules that are not Linear layers of this draft: "
                         f"{bad[:5]}; the package was quantized from another draft")
    module.float()
    quantize_dynamic(module, {n: per_channel_dynamic_qconfig for n in names}, inplace=True)
    return module


def record(module: nn.Module, scheme: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ``draftsmith.json["quantization"]`` entry for quantizing ``module``."""
    return {"scheme": scheme, "modules": quantizable(module, skip),
            "activations": "float32, quantized per call (dynamic)",
            "weights": "int8, symmetric per output channel"}
