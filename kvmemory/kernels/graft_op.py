"""The graft op: copy a chain of verified KV blocks from a staging buffer into the model's cache.

`graft_copy` writes every block's K and V bytes, for every layer, at the block's own token positions
of the per-layer cache tensors. Bytes are copied, never values: no dtype conversion happens anywhere,
so NaN payloads, -0.0 and every other bit pattern land exactly as stored.

Two implementations share one signature and one argument validation (run in full before a single
byte is copied):

* `cuda`: the kvmemory_cuda_graft kernel (kernels/cuda_graft), one launch for all blocks x layers x {K,V} x heads on
  the current CUDA stream, reading pinned host staging directly over the link (zero-copy) or device
  staging. Asynchronous with respect to the host, like any CUDA op.
* `twin`: pure PyTorch, byte views (uint8) and slice copies. The CPU path and the kernel's test oracle.

The choice is made ONCE, at import, and recorded in `IMPL` ("cuda" or "twin"; `IMPL_REASON` says
why). Automatic choice: `cuda` when the kvmemory_cuda_graft library loads and torch sees a CUDA device, else
`twin`; with `cuda` chosen, destinations on the CPU still use the twin. `KVMEMORY_GRAFT_OP=twin`
forces the twin; `KVMEMORY_GRAFT_OP=cuda` forces the kernel and raises `GraftOpUnavailable` at import
when it cannot be used (and ValueError for CPU destinations): a forced choice never falls back.

Payload layout (the contract with the store and the engine)
-----------------------------------------------------------
A block covers T >= 1 consecutive token positions starting at absolute position `pos`. Its payload is
raw bytes: for layer l = 0..L-1, K_l then V_l, each a C-contiguous [H_l, T, D_l] array of the cache
dtype (element size `esize`: 4 for fp32, 2 for bf16/fp16). Payload bytes = T * sum_l 2*H_l*D_l*esize.
(K and V of a layer may also differ in heads / head dim, [Hk_l, T, Dk_l] then [Hv_l, T, Dv_l], for
architectures whose value head dim differs; the destinations' shapes say which.)
Destination per layer: contiguous [1, H_l, S_l, D_l] tensors (K and V with the same S_l and dtype);
the block lands at token rows [pos - off_l, pos - off_l + T) and rows outside [0, S_l) are skipped
(sliding-window layers keep only a suffix: off_l = first absolute position they hold).
"""

from __future__ import annotations

import operator
import os
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "IMPL", "IMPL_REASON", "GraftOpUnavailable", "graft_copy", "twin_graft_copy", "cuda_graft_copy",
    "payload_nbytes", "pack_payload", "pinned_staging",
]


class GraftOpUnavailable(RuntimeError):
    """KVMEMORY_GRAFT_OP=cuda was asked for but the kvmemory_cuda_graft kernel cannot run here."""


# ---------------------------------------------------------------------------------------------------
# Validation and planning (shared by both implementations)


@dataclass(slots=True, frozen=True)
class _Layer:
    k_heads: int         # Hk_l
    k_dim: int           # Dk_l
    v_heads: int         # Hv_l
    v_dim: int           # Dv_l
    seq: int             # S_l
    off: int             # off_l
    payload_prefix: int  # bytes per token of layers < l (sum (Hk*Dk + Hv*Dv)*esize)


@dataclass(slots=True, frozen=True)
class _Plan:
    esize: int
    bytes_per_token: int                     # sum over layers of (Hk*Dk + Hv*Dv)*esize
    layers: tuple[_Layer, ...]
    blocks: tuple[tuple[int, int, int], ...]  # (byte offset, pos, tokens)


def _ints(name: str, values: Sequence[int]) -> list[int]:
    if isinstance(values, (str, bytes, torch.Tensor)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a sequence of Python integers, got {type(values).__name__}")
    values = list(values)
    if any(isinstance(v, bool) for v in values):
        raise ValueError(f"{name} must hold integers, not booleans")
    try:
        return [operator.index(v) for v in values]
    except TypeError as exc:
        raise ValueError(f"{name} must be a sequence of integers: {exc}") from None


def _plan(staging: torch.Tensor, block_offsets: Sequence[int], block_positions: Sequence[int],
          block_tokens: Sequence[int], dst_k: Sequence[torch.Tensor], dst_v: Sequence[torch.Tensor],
          dst_offsets: Sequence[int] | None) -> _Plan:
    """Checks every argument and returns what both implementations need. Raises ValueError."""
    if not isinstance(staging, torch.Tensor):
        raise ValueError(f"staging must be a torch.Tensor, got {type(staging).__name__}")
    if staging.dtype != torch.uint8 or staging.dim() != 1:
        raise ValueError(
            f"staging must be a 1-D uint8 tensor, got {staging.dtype} of shape {tuple(staging.shape)}"
        )
    if not staging.is_contiguous():
        raise ValueError("staging must be contiguous")
    offsets = _ints("block_offsets", block_offsets)
    positions = _ints("block_positions", block_positions)
    tokens = _ints("block_tokens", block_tokens)
    if not (len(offsets) == len(positions) == len(tokens)):
        raise ValueError(
            f"block_offsets, block_positions and block_tokens differ in length "
            f"({len(offsets)}, {len(positions)}, {len(tokens)})"
        )
    dst_k, dst_v = list(dst_k), list(dst_v)
    if not dst_k or len(dst_k) != len(dst_v):
        raise ValueError(f"dst_k and dst_v must be non-empty and of equal length ({len(dst_k)} vs {len(dst_v)})")
    n_layers = len(dst_k)
    offs = [0] * n_layers if dst_offsets is None else _ints("dst_offsets", dst_offsets)
    if len(offs) != n_layers:
        raise ValueError(f"dst_offsets has {len(offs)} entries for {n_layers} layers")
    ref = dst_k[0]
    if not isinstance(ref, torch.Tensor):
        raise ValueError(f"dst_k[0] must be a torch.Tensor, got {type(ref).__name__}")
    esize = ref.element_size()
    layers: list[_Layer] = []
    prefix = 0
    for i in range(n_layers):
        for name, t in (("dst_k", dst_k[i]), ("dst_v", dst_v[i])):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4 or t.shape[0] != 1:
                raise ValueError(f"{name}[{i}] must have shape [1, H, S, D], got {tuple(t.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"{name}[{i}] must be contiguous")
            if t.dtype != ref.dtype:
                raise ValueError(
                    f"{name}[{i}] is {t.dtype} but dst_k[0] is {ref.dtype}: one cache dtype for all layers"
                )
            if t.device != ref.device:
                raise ValueError(f"{name}[{i}] is on {t.device} but dst_k[0] is on {ref.device}")
        _, hk, s, dk = dst_k[i].shape
        _, hv, sv, dv = dst_v[i].shape
        if sv != s:
            raise ValueError(
                f"layer {i}: dst_k shape {tuple(dst_k[i].shape)} and dst_v shape {tuple(dst_v[i].shape)} "
                "hold different numbers of token rows"
            )
        if min(hk, dk, hv, dv) < 1:
            raise ValueError(f"layer {i}: need H >= 1 and D >= 1, got shapes {tuple(dst_k[i].shape)}, "
                             f"{tuple(dst_v[i].shape)}")
        if dst_k[i].numel() and dst_k[i].data_ptr() == dst_v[i].data_ptr():
            raise ValueError(f"layer {i}: dst_k and dst_v are the same memory")
        if offs[i] < 0:
            raise ValueError(f"dst_offsets[{i}] must be >= 0, got {offs[i]}")
        layers.append(_Layer(hk, dk, hv, dv, s, offs[i], prefix))
        prefix += (hk * dk + hv * dv) * esize
    n = staging.numel()
    spans = []
    for b, (o, p, t) in enumerate(zip(offsets, positions, tokens)):
        if t < 1:
            raise ValueError(f"block {b}: block_tokens must be >= 1, got {t}")
        if p < 0:
            raise ValueError(f"block {b}: block_positions must be >= 0, got {p}")
        if o < 0 or o + t * prefix > n:
            raise ValueError(
                f"block {b}: payload [{o}, {o + t * prefix}) ({t} tokens x {prefix} bytes) "
                f"does not fit in staging of {n} bytes"
            )
        spans.append((p, p + t, b))
    spans.sort()
    for (p0, e0, b0), (p1, _, b1) in zip(spans, spans[1:]):
        if p1 < e0:
            raise ValueError(f"blocks {b0} and {b1} overlap in token positions ([{p0}, {e0}) and from {p1})")
    return _Plan(esize, prefix, tuple(layers), tuple(zip(offsets, positions, tokens)))


def _window(pos: int, tokens: int, layer: _Layer) -> tuple[int, int, int]:
    """(p, t0, t1): destination row of the block's first token and the in-range token window."""
    p = pos - layer.off
    return p, max(0, -p), min(tokens, layer.seq - p)


# ---------------------------------------------------------------------------------------------------
# Twin (pure PyTorch)


def _twin_apply(staging: torch.Tensor, plan: _Plan, dst_k: Sequence[torch.Tensor],
                dst_v: Sequence[torch.Tensor]) -> None:
    if not plan.blocks:
        return
    device = dst_k[0].device
    base = 0
    if staging.device != device:
        # One transfer of the span the blocks use instead of one per (block, layer, K|V).
        lo = min(o for o, _, _ in plan.blocks)
        hi = max(o + t * plan.bytes_per_token for o, _, t in plan.blocks)
        staging, base = staging[lo:hi].to(device), lo
    # Integer views: [1, H, S, D*esize/w] of the widest integer type w that divides the row bytes.
    # Copies between integer tensors move bytes, never values (no casts, NaN payloads survive); the
    # wide type lets the copy kernel move 8 bytes per element instead of 1.
    word = _word_dtype(plan, dst_k, dst_v, staging)
    wsize = torch.empty(0, dtype=word).element_size()
    kb = [t.view(torch.uint8).view(word) for t in dst_k]
    vb = [t.view(torch.uint8).view(word) for t in dst_v]
    for o, pos, t in plan.blocks:
        for li, layer in enumerate(plan.layers):
            p, t0, t1 = _window(pos, t, layer)
            if t1 <= t0:
                continue
            start = o - base + t * layer.payload_prefix
            krow, vrow = layer.k_dim * plan.esize, layer.v_dim * plan.esize
            mid = start + layer.k_heads * t * krow
            k_src = staging[start:mid].view(word).view(layer.k_heads, t, krow // wsize)
            v_src = staging[mid:mid + layer.v_heads * t * vrow].view(word).view(layer.v_heads, t, vrow // wsize)
            kb[li][0, :, p + t0:p + t1, :].copy_(k_src[:, t0:t1, :])
            vb[li][0, :, p + t0:p + t1, :].copy_(v_src[:, t0:t1, :])


def _word_dtype(plan: _Plan, dst_k, dst_v, staging: torch.Tensor) -> torch.dtype:
    """The widest of int64/int32/int16/uint8 whose size divides every row and every start offset."""
    sizes = [layer.k_dim * plan.esize for layer in plan.layers] + [layer.v_dim * plan.esize for layer in plan.layers]
    sizes += [o for o, _, _ in plan.blocks] + [staging.storage_offset()]
    sizes += [t.storage_offset() * t.element_size() for t in (*dst_k, *dst_v)]
    for dt, w in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if all(x % w == 0 for x in sizes):
            return dt
    return torch.uint8


def twin_graft_copy(staging: torch.Tensor, block_offsets: Sequence[int],
                    block_positions: Sequence[int], block_tokens: Sequence[int],
                    dst_k: Sequence[torch.Tensor], dst_v: Sequence[torch.Tensor],
                    dst_offsets: Sequence[int] | None = None) -> None:
    """Pure-PyTorch graft: same contract as `graft_copy`; works on any device pair."""
    plan = _plan(staging, block_offsets, block_positions, block_tokens, dst_k, dst_v, dst_offsets)
    _twin_apply(staging, plan, dst_k, dst_v)


# ---------------------------------------------------------------------------------------------------
# CUDA kernel (kvmemory_cuda_graft)

_kernel = None           # kvmemory_cuda_graft.Library once loaded
_kernel_arch: str | None = None
_covered: dict[int, bool] = {}
# (event, staging) of kernel launches still possibly reading their staging: holding the tensor keeps
# torch's allocators from recycling its memory under a running kernel (they only know about their own
# copies), and pinned_staging() waits on these events before handing a buffer out for refilling.
_pending: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()
_pending_lock = threading.Lock()


def _prune_pending() -> None:
    with _pending_lock:
        while _pending and _pending[0][0].query():
            _pending.popleft()


def _ensure_covered(device: torch.device) -> None:
    """Makes sure the loaded library has code for this device (SASS or JIT-able PTX)."""
    global _kernel, _kernel_arch
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if _covered.get(idx):
        return
    import kvmemory_cuda_graft

    cap = torch.cuda.get_device_capability(idx)
    if not kvmemory_cuda_graft.covers(_kernel_arch, cap):
        arch = kvmemory_cuda_graft.merge_arch_lists(_kernel_arch or "", f"{cap[0]}.{cap[1]}")
        try:
            _kernel, _kernel_arch = kvmemory_cuda_graft.load(arch), arch
        except kvmemory_cuda_graft.CudaGraftUnavailable as exc:
            raise GraftOpUnavailable(
                f"libkvgraft has no code for compute capability {cap[0]}.{cap[1]} and cannot be "
                f"rebuilt for it: {exc}"
            ) from exc
    _covered[idx] = True


def _kernel_tables(plan: _Plan, dst_k: Sequence[torch.Tensor], dst_v: Sequence[torch.Tensor]):
    """The kernel's descriptor tables (ctypes arrays of kvmemory_cuda_graft.Block / kvmemory_cuda_graft.Layer)."""
    import kvmemory_cuda_graft

    blocks = (kvmemory_cuda_graft.Block * len(plan.blocks))(*[kvmemory_cuda_graft.Block(o, p, t, 0) for o, p, t in plan.blocks])
    layers = (kvmemory_cuda_graft.Layer * len(plan.layers))()
    rows = 0
    for i, (lay, k, v) in enumerate(zip(plan.layers, dst_k, dst_v)):
        layers[i] = kvmemory_cuda_graft.Layer(k.data_ptr(), v.data_ptr(), lay.k_heads, lay.k_dim, lay.v_heads,
                                  lay.v_dim, lay.seq, lay.off, lay.payload_prefix, rows)
        rows += lay.k_heads + lay.v_heads
    return blocks, layers


def cuda_graft_copy(staging: torch.Tensor, block_offsets: Sequence[int],
                    block_positions: Sequence[int], block_tokens: Sequence[int],
                    dst_k: Sequence[torch.Tensor], dst_v: Sequence[torch.Tensor],
                    dst_offsets: Sequence[int] | None = None) -> None:
    """The kvmemory_cuda_graft kernel: same contract as `graft_copy`, CUDA destinations only.

    staging: pinned host memory (read by the GPU over the link) or memory of the destination's GPU;
    pageable host memory works too but is first copied to the device in one (synchronous) transfer.
    Runs on `torch.cuda.current_stream(dst device)` and returns before the copy finishes: do not
    modify the staging bytes until that stream has passed this point (`pinned_staging` waits for it).
    """
    if _kernel is None:
        raise GraftOpUnavailable(f"the kvmemory_cuda_graft kernel is not loaded ({IMPL_REASON})")
    plan = _plan(staging, block_offsets, block_positions, block_tokens, dst_k, dst_v, dst_offsets)
    device = dst_k[0].device
    if device.type != "cuda":
        raise ValueError(f"the CUDA graft op needs CUDA destinations, got {device}")
    if staging.device.type == "cuda" and staging.device != device:
        raise ValueError(f"staging is on {staging.device} but the destination is on {device}")
    if staging.device.type not in ("cpu", "cuda"):
        raise ValueError(f"staging must be host or CUDA memory, got {staging.device}")
    if not plan.blocks:
        return
    if staging.device.type == "cpu" and not staging.is_pinned():
        # The GPU cannot read pageable memory: move the span the blocks use to the device in one
        # transfer (synchronous for pageable memory) and graft from there. Correct, but slower than
        # pinned staging read in place; use pinned_staging() on CUDA machines.
        lo = min(o for o, _, _ in plan.blocks)
        hi = max(o + t * plan.bytes_per_token for o, _, t in plan.blocks)
        staging = staging[lo:hi].to(device)
        plan = _Plan(plan.esize, plan.bytes_per_token, plan.layers,
                     tuple((o - lo, p, t) for o, p, t in plan.blocks))
    _ensure_covered(device)
    blocks, layers = _kernel_tables(plan, dst_k, dst_v)
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        _kernel.copy(device.index if device.index is not None else torch.cuda.current_device(),
                     staging.data_ptr(), blocks, layers, plan.esize, stream.cuda_stream)
        event = torch.cuda.Event()
        event.record(stream)
    _prune_pending()
    with _pending_lock:
        _pending.append((event, staging))


# ---------------------------------------------------------------------------------------------------
# Dispatch (chosen once, at import)


def _select(env: str) -> tuple[str, bool, str]:
    """(impl, forced, reason) for a KVMEMORY_GRAFT_OP value; loads the kernel when it is chosen."""
    global _kernel, _kernel_arch
    choice = env.strip().lower()
    if choice not in ("", "auto", "twin", "cuda"):
        raise ValueError(f"KVMEMORY_GRAFT_OP={env!r}: use 'twin', 'cuda' or leave it unset")
    if choice == "twin":
        return "twin", True, "KVMEMORY_GRAFT_OP=twin"
    forced = choice == "cuda"
    why = ""
    if not torch.cuda.is_available():
        why = "torch sees no CUDA device"
    else:
        try:
            import kvmemory_cuda_graft
        except ImportError as exc:
            why = f"the kvmemory_cuda_graft package is not installed ({exc}); pip install -e kernels/cuda_graft"
        else:
            try:  # may compile the library once (cached); any failure means "unavailable"
                st = kvmemory_cuda_graft.status()
                if st.available:
                    _kernel, _kernel_arch = kvmemory_cuda_graft.load(), st.arch_list
                    return "cuda", forced, f"kvmemory_cuda_graft kernel {st.library} ({st.arch_list or 'prebuilt'})"
                why = st.reason
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
    if forced:
        raise GraftOpUnavailable(f"KVMEMORY_GRAFT_OP=cuda but the CUDA graft kernel cannot be used: {why}")
    return "twin", False, f"twin (kernel unavailable: {why})"


IMPL, _FORCED, IMPL_REASON = _select(os.environ.get("KVMEMORY_GRAFT_OP", ""))


def graft_copy(staging: torch.Tensor,            # uint8 [N]: host (pinned for the kernel) or device
               block_offsets: Sequence[int],     # byte offset of each block's payload in staging
               block_positions: Sequence[int],   # absolute start position of each block
               block_tokens: Sequence[int],      # T of each block (>= 1)
               dst_k: Sequence[torch.Tensor],    # per layer [1, H_l, S_l, D_l], contiguous
               dst_v: Sequence[torch.Tensor],    # per layer [1, H_l, S_l, D_l], contiguous
               dst_offsets: Sequence[int] | None = None,  # per layer token offset off_l (default 0)
               ) -> None:
    """Copies block payloads (layout in the module docstring) into the per-layer K/V caches.

    Every argument is validated (ValueError) before anything is copied. Blocks must not overlap in
    token positions. With the kernel the copy is asynchronous on the current CUDA stream.
    """
    on_cuda = bool(dst_k) and isinstance(dst_k[0], torch.Tensor) and dst_k[0].device.type == "cuda"
    if IMPL == "cuda" and (on_cuda or _FORCED):
        cuda_graft_copy(staging, block_offsets, block_positions, block_tokens, dst_k, dst_v, dst_offsets)
    else:
        twin_graft_copy(staging, block_offsets, block_positions, block_tokens, dst_k, dst_v, dst_offsets)


# ---------------------------------------------------------------------------------------------------
# Helpers for writers and for the CUDA path


def payload_nbytes(dst_k: Sequence[torch.Tensor], dst_v: Sequence[torch.Tensor], tokens: int) -> int:
    """Bytes of one block payload of `tokens` tokens for caches shaped like dst_k / dst_v."""
    return tokens * sum(t.shape[1] * t.shape[3] * t.element_size() for t in (*dst_k, *dst_v))


def pack_payload(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], start: int,
                 tokens: int) -> torch.Tensor:
    """The payload (uint8, on the caches' device) of cache rows [start, start + tokens): the inverse
    of graft_copy with zero offsets. keys/values: per layer [1, H_l, S_l, D_l]."""
    parts = []
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        if (k.dim() != 4 or v.dim() != 4 or k.shape[0] != 1 or v.shape[0] != 1 or k.shape[2] != v.shape[2]
                or k.dtype != v.dtype):
            raise ValueError(f"layer {i}: keys/values must be [1, H, S, D] tensors with the same S and dtype")
        if start < 0 or tokens < 1 or start + tokens > k.shape[2]:
            raise ValueError(f"layer {i}: rows [{start}, {start + tokens}) outside S={k.shape[2]}")
        for t in (k, v):
            # contiguous() of the [H, T, D] slice, then a byte view: no value conversion.
            parts.append(t[0, :, start:start + tokens, :].contiguous().view(torch.uint8).reshape(-1))
    return torch.cat(parts)


_staging_lock = threading.Lock()
_staging: dict[int, torch.Tensor] = {}


def pinned_staging(nbytes: int, slot: int = 0) -> torch.Tensor:
    """A reusable host staging buffer (uint8 [nbytes]), pinned when CUDA is available.

    One buffer per `slot` (use two slots to fill one while the GPU reads the other), grown by
    doubling. Before handing a buffer out again this waits until every kernel graft that read from it
    has finished, so the caller may overwrite it at once.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    with _staging_lock:
        buf = _staging.get(slot)
        if buf is None or buf.numel() < nbytes:
            cap = max(1 << 20, 1 << max(nbytes - 1, 0).bit_length())
            buf = torch.empty(cap, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            _staging[slot] = buf
    ptr = buf.untyped_storage().data_ptr()
    with _pending_lock:
        waits = [ev for ev, st in _pending if st.untyped_storage().data_ptr() == ptr]
    for ev in waits:
        ev.synchronize()
    _prune_pending()
    return buf[:nbytes]
