"""Linear layers with weights packed once for oneDNN: the GEMMs kvmemory's CPU profile runs.

`torch.nn.functional.linear` on the CPU calls MKL's sgemm (float32) or oneDNN (bfloat16) with the
plain `[out, in]` weight, which is re-laid out for the kernel on every call. With the few rows a
graft computes (16 new tokens, or 1 while decoding) that re-layout costs about as much as the
product itself. Packing each weight once at load into oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, the op Inductor's CPU backend uses) and calling
`torch.ops.mkldnn._linear_pointwise` makes the layer GEMMs of the embedded model ~1.4x faster at 16
rows and its lm_head 2-2.8x (measured on the 2-core EPYC of BENCHMARKS.md), for the canonical
recompute and the graft alike.

Exactness: a packed GEMM rounds differently from sgemm, so the implementation is part of the
execution profile (`linear_impl`, read from the model by `implementation`): blocks made with plain
linears are refused under packed ones, with the field named. For one shape it is deterministic
(tested: same bytes whatever the input's alignment, run after run).

Cost: each packed weight is a second copy next to the original (`weight` stays, so `state_dict`,
tied embeddings and the weights fingerprint are untouched): +540 MB for the float32 default model.

Chosen once, at load (`models.loading.load_model`), on the CPU for float32 and bfloat16, when this torch
has the ops, for every model but the embedded one where its GGUF blocks compute instead
(gguf_linear.py: a fifth of the bytes per step); otherwise the model keeps its plain linears and
the profile says `aten`.
"""

from __future__ import annotations

import torch


NAME = "onednn-packed"
PLAIN = "aten"

# The row count oneDNN picks the packed layout for: a graft's tail and a decode step compute few
# rows; the same layout serves every row count (the grid's 64 rows ran no faster packed for 64).
_PACK_ROWS = 16

# Chosen once, at import: whether this torch build can pack, and for which dtypes.
AVAILABLE = torch.backends.mkldnn.is_available() and all(
    hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise"))
PACKABLE_DTYPES: set[torch.dtype] = set()
if AVAILABLE:
    PACKABLE_DTYPES.add(torch.float32)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        PACKABLE_DTYPES.add(torch.bfloat16)


class PackedLinear(torch.nn.Linear):
    """An `nn.Linear` computing with a oneDNN-packed copy of its (frozen) weight."""

    packed: torch.Tensor

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "PackedLinear":
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight  # the same Parameter: ties (lm_head = embeddings) stay tied
        new.bias = linear.bias
        new.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _PACK_ROWS)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every plain `nn.Linear` of a CPU model by a `PackedLinear` (in place); returns how
    many. Does nothing where packing is unavailable (another device, dtype or torch build)."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype not in PACKABLE_DTYPES:
        return 0
    targets = [(name, m) for name, m in model.named_modules() if type(m) is torch.nn.Linear
               and m.weight.dtype == param.dtype]
    for name, m in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, PackedLinear.from_linear(m))
    return len(targets)
