"""Linear layers computed from the GGUF file's own quantized blocks (kernels/csrc/quantized_linear.cpp).

The embedded model is a GGUF file (Q4_1 layers, a Q8_0 embedding that is also the output layer);
transformers dequantizes it to float32, 540 MB of linear weights. A graft's step computes 16 rows
(1 while decoding), so every step streams all of them: on a 2-core VM that is most of the step, and
why llama.cpp, reading the same file's ~96 MB of blocks, used to be faster at short prompts. Here each
linear of a llama-architecture model keeps the GGUF's blocks (re-laid out in panels of 16 output rows,
~110 MB in all) and the kernel expands them to float32 in cache while it multiplies. All 211
linears of the embedded model (`python -m kvmemory.bench.linears` times them on yours), on the 2-core
AVX-512 Xeon of BENCHMARKS.md: 1 row 13.9 ms, 16 rows 30.1 ms, 64 rows 76.4 ms; oneDNN-packed
float32 weights 2.0x, 1.6x and 1.4x that, torch's own GEMM 1.6x, 1.7x and 1.4x. One row (a decode
step) has its own path in the kernel since (weights expanded in registers, 8 panels in flight): on a
2-core Zen 4, 8.7 ms where the tiled path took 12.8 ms.

Exactness: the kernel expands every weight to the very float32 value transformers' loader gives
(gguf-py's `d * q + m`), and `gguf_linears` checks that byte for byte against the model's weights
before replacing a layer. The products are summed in one fixed order (k ascending, one FMA each), so
a row's bits depend on nothing else: not the number of rows, the thread count, nor AVX-512 vs AVX2.
That order is not sgemm's or oneDNN's, so the implementation is part of the execution profile
(`linear_impl` = `gguf-blocks`, read by `loading.linear_implementation`).

Chosen at load (`models.loading.load_model`) for the embedded model on an AVX-512 or AVX2 CPU; elsewhere,
and for any model not read from a GGUF file, linears are packed for oneDNN (packed_linear.py). The float32
`weight` stays (state_dict, tied embeddings and the weights fingerprint are untouched; no packed copy).
The kernel and its panel layout are kernels/quantized_linear.py (a plain C library built into the
package, AVX-512 and AVX2 builds); where none runs, it says why once and the linears are packed instead.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from kvmemory.errors import KVMemoryError
from kvmemory.kernels import quantized_linear as qlinear
from kvmemory.kernels.quantized_linear import KINDS, PANEL
from kvmemory.models import cache_files
from kvmemory.models import gguf_blocks

log = logging.getLogger(__name__)

NAME = "gguf-blocks"
# `linears="q8"`: the same blocks, multiplied as llama.cpp does (8-bit activations, integer dot products:
# kernels/csrc/q8_dot.h). Another sum, so another `linear_impl`; exact graft = recompute and
# batch-invariant rows as gguf-blocks, but no longer gguf-py's float32 weights summed in float32.
NAME_Q8 = "gguf-blocks-q8"


class GGUFLinear(torch.nn.Linear):
    """An `nn.Linear` computing with its weight's GGUF blocks; `weight` stays as it was (a float32 copy
    for the embedded model's checked layers, an unallocated meta tensor for a GGUF file's: gguf_model.py).
    A bias (Qwen2's q/k/v) is added to each output after its sum: still one fixed order per row."""

    def __init__(self, linear: torch.nn.Linear, kind: str | int, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The same Parameter: ties (lm_head = embeddings) stay tied. A GGUF file's layer has none (its meta
        # placeholder is dropped, so that parameters() lists only real tensors: gguf_model.py).
        self.weight = None if linear.weight is None or linear.weight.is_meta else linear.weight
        self.bias = linear.bias
        # kind: a GGUF block type's name, or the kernel's kind code (kernels/quantized_linear.py)
        self.kind, self.q, self.d, self.m = (KINDS[kind] if isinstance(kind, str) else int(kind)), q, d, m
        # The panels are checked once here, not per call (a decode step calls 211 of these for one row
        # each, where ~10 us of checks per call would be a tenth of the step); they are never changed.
        k = qlinear.in_features(q, d, m, self.kind)
        if k != self.in_features or q.shape[0] * PANEL != self.out_features:
            raise ValueError(f"panels for a {q.shape[0] * PANEL} x {k} weight, not {self.out_features} x {self.in_features}")
        lib = qlinear.load()
        self._fn = lib.kvm_qlinear_linear if lib is not None else None  # called without a lookup per step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        if rows.dtype is not torch.float32 or not rows.is_cpu or self._fn is None:  # says what is wrong
            y = qlinear.linear(rows, self.q, self.d, self.m, self.kind)
            if self.bias is not None:
                y.add_(self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        M = rows.shape[0]
        y = torch.empty((M, self.out_features), dtype=torch.float32)
        rc = self._fn(self.kind, rows.data_ptr(), M, self.q.data_ptr(), *self.pointers(), self.q.shape[0],
                      self.in_features, y.data_ptr(), torch.get_num_threads())
        if rc:
            qlinear.check_rc(rc)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def pointers(self) -> tuple[int | None, int | None]:
        """The addresses of d and m the kernel takes (None where the format has none)."""
        if not hasattr(self, "_pointers"):
            self._pointers = qlinear.pointers(self.d, self.m, self.kind)
        return self._pointers

    def dequantized(self) -> torch.Tensor:
        """The float32 weight the blocks hold, expanded by the kernel's own code."""
        return qlinear.dequantize(self.q, self.d, self.m, self.kind)


def to_q8(model: torch.nn.Module) -> int:
    """Make every GGUF-block linear of `model` with quantized blocks compute as `linears="q8"` (in place:
    its q re-laid for 8-bit activations, d and m kept); float weights (F32 / F16 / BF16) stay float
    sums. Returns how many. Run before the lean step fuses layers (it fuses what it finds)."""
    n = 0
    for module in model.modules():
        if isinstance(module, GGUFLinear) and qlinear.decode_kind(module.kind)[0] != qlinear.F32 \
                and not qlinear.is_q8(module.kind):
            module.q, module.kind = qlinear.to_q8(module.q, module.kind)
            n += 1
    return n


def implementation(module: GGUFLinear) -> str:
    """The `linear_impl` a GGUF-block linear computes as."""
    return NAME_Q8 if qlinear.is_q8(module.kind) else NAME


def fuse(layers: list[GGUFLinear]) -> GGUFLinear:
    """One GGUFLinear computing `layers` side by side (a decode step's q/k/v, or gate/up, in one call):
    its output is theirs concatenated, each output the same sum, so the same bits. The layers' panels
    become views of the fused ones (no second copy); they compute as before. The fused layer is no
    model's submodule: state_dict and the weights fingerprint do not see it."""
    first = layers[0]
    if any(not isinstance(l, GGUFLinear) or l.kind != first.kind or l.in_features != first.in_features
           or (l.bias is None) != (first.bias is None) for l in layers):
        raise ValueError("only GGUF-block linears of one block format, one input size and all with or all without "
                         "a bias fuse")
    fmt = qlinear.decode_kind(first.kind)[0]
    empty = torch.empty(0, dtype=torch.float32)
    q = torch.cat([l.q for l in layers])
    d = torch.cat([l.d for l in layers]) if fmt != qlinear.F32 else empty
    m = torch.cat([l.m for l in layers]) if qlinear.has_m(first.kind) else empty
    shell = torch.nn.Linear(first.in_features, q.shape[0] * PANEL, bias=False, device="meta")
    fused = GGUFLinear(shell, first.kind, q, d, m)
    if first.bias is not None:  # each output's bias added after its sum, as each layer adds its own
        fused.bias = torch.nn.Parameter(torch.cat([l.bias.detach() for l in layers]), requires_grad=False)
    p = 0
    for l in layers:
        n = l.q.shape[0]
        l.q = q[p:p + n]
        if fmt != qlinear.F32:
            l.d = d[p:p + n]
        if qlinear.has_m(first.kind):
            l.m = m[p:p + n]
        if hasattr(l, "_pointers"):
            del l._pointers
        p += n
    return fused


def panels(kind: str, raw: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF tensor's raw blocks ([n, bytes per row] uint8, one row per output feature) in the
    kernel's panel layout: q, d, m (gguf_blocks.panels, which also gives the kernel's kind code)."""
    return gguf_blocks.panels(kind, raw, n, k)[:3]


def _llama_sources(model: torch.nn.Module) -> dict[str, tuple[str, int | None]]:
    """Module name -> (GGUF tensor name, heads whose rows llama.cpp's converter interleaved, or None)."""
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    out = {}
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        out[pre + "self_attn.q_proj"] = (f"blk.{i}.attn_q.weight", heads)
        out[pre + "self_attn.k_proj"] = (f"blk.{i}.attn_k.weight", kv_heads)
        out[pre + "self_attn.v_proj"] = (f"blk.{i}.attn_v.weight", None)
        out[pre + "self_attn.o_proj"] = (f"blk.{i}.attn_output.weight", None)
        out[pre + "mlp.gate_proj"] = (f"blk.{i}.ffn_gate.weight", None)
        out[pre + "mlp.up_proj"] = (f"blk.{i}.ffn_up.weight", None)
        out[pre + "mlp.down_proj"] = (f"blk.{i}.ffn_down.weight", None)
    out["lm_head"] = ("output.weight", None)
    return out


def _unpermute_rows(raw: np.ndarray, heads: int) -> np.ndarray:
    """Undo the q/k row interleave of llama.cpp's converter, as transformers'
    `_reverse_permute_weights` does on the dequantized rows (rows are whole blocks, so it moves them)."""
    n = raw.shape[0]
    rows = np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(2, 1).reshape(n)
    return raw[rows]


def _panels_from_gguf(model: torch.nn.Module, gguf_path: Path) -> dict[str, torch.Tensor]:
    """Every replaced layer's panels, read from the GGUF file: {name + ".q" / ".d" / ".m" / ".kind"}."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(gguf_path)).tensors}
    if "output.weight" not in tensors and "token_embd.weight" in tensors:
        tensors["output.weight"] = tensors["token_embd.weight"]  # tied: the embedding is the output layer
    out = {}
    for name, (source, heads) in _llama_sources(model).items():
        module, tensor = model.get_submodule(name), tensors.get(source)
        if tensor is None:
            raise KVMemoryError(f"{gguf_path} has no tensor {source} for {name}")
        raw = np.asarray(tensor.data)
        if raw.shape[0] != module.out_features:
            raise KVMemoryError(f"{source} has {raw.shape[0]} rows, {name} {module.out_features}")
        if heads is not None:
            raw = _unpermute_rows(raw, heads)
        q, d, m, kind = gguf_blocks.panels(tensor.tensor_type.name, raw, module.out_features, module.in_features)
        out.update({f"{name}.q": q, f"{name}.d": d, f"{name}.m": m, f"{name}.kind": torch.tensor([kind])})
    return out


def _checked(model: torch.nn.Module, stored: dict[str, torch.Tensor], origin: Path) -> dict[str, GGUFLinear]:
    """A GGUFLinear per layer from `stored` panels, each checked to expand to the layer's weights."""
    replacements = {}
    for name in _llama_sources(model):
        module = model.get_submodule(name)
        try:
            kind = int(stored[f"{name}.kind"])
            new = GGUFLinear(module, kind, stored[f"{name}.q"], stored[f"{name}.d"], stored[f"{name}.m"])
            same = torch.equal(new.dequantized(), module.weight.detach())
        except (KeyError, ValueError, RuntimeError) as exc:  # missing or misshapen: the checks say how
            raise KVMemoryError(f"the GGUF panels for {name} in {origin} are unusable: {exc}") from exc
        if not same:
            raise KVMemoryError(f"the GGUF blocks for {name} in {origin} do not expand to its weights")
        replacements[name] = new
    return replacements


def gguf_linears(model: torch.nn.Module, gguf_path: str | Path, cache: str | Path | None = None) -> int:
    """Replace the linears of a llama-architecture float32 CPU model by `GGUFLinear`s computing from
    `gguf_path`'s blocks (in place); returns how many. The panels are kept in `cache` (a safetensors
    file, written on first use: reading the GGUF's header takes seconds) and, read from there or
    not, every layer is checked to expand to the model's weights byte for byte before it is used.
    Raises KVMemoryError, leaving the model as it was, where this cannot be done exactly: the kernel
    does not run here, another architecture or dtype, a tensor of another block type, or blocks that
    do not expand to the model's weights."""
    import safetensors
    from safetensors.torch import load_file, save_file

    if qlinear.load() is None:
        raise KVMemoryError(f"the GGUF-block linear kernel cannot run here: {qlinear.why_unavailable()}")
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        raise KVMemoryError("GGUF-block linears compute a float32 model on the CPU")
    if getattr(model.config, "model_type", None) != "llama":
        raise KVMemoryError(f"GGUF-block linears know the llama architecture's tensor names, not "
                            f"{getattr(model.config, 'model_type', None)!r}")
    for name in _llama_sources(model):
        module = model.get_submodule(name)
        if not isinstance(module, torch.nn.Linear) or module.bias is not None:
            raise KVMemoryError(f"{name} is not a bias-free linear layer")
    cache = Path(cache) if cache is not None else None
    replacements = None
    if cache is not None and cache.exists():
        try:
            replacements = _checked(model, load_file(str(cache)), cache)
        except (KVMemoryError, OSError, safetensors.SafetensorError) as exc:  # derived data: made again below
            log.warning("kvmemory: %s; reading the GGUF file again", exc)
    if replacements is None:
        stored = _panels_from_gguf(model, Path(gguf_path))
        replacements = _checked(model, stored, Path(gguf_path))
        if cache is not None:
            # Written whole under a temporary name, then renamed: readers see all of it or none. One writer
            # at a time (flock, dropped by the kernel if the writer is killed); a temporary file seen while
            # holding the lock is a killed writer's, removed.
            with cache_files.exclusive(cache.with_name(f".{cache.name}.lock"), "the GGUF panels"):
                cache_files.remove_leftovers(cache.parent, f".{cache.name}.tmp-")
                tmp = cache.with_name(f".{cache.name}.tmp-{os.getpid()}")
                save_file(stored, str(tmp))
                os.replace(tmp, cache)
    for name, new in replacements.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return len(replacements)
