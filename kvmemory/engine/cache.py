"""The canonical runner's KV cache: transformers' `DynamicCache` whose full-attention layers write
into reserved room instead of concatenating.

`DynamicLayer.update` does `torch.cat([keys, new])`: every grid chunk copies the whole cache of every
layer, O(L^2 / C) bytes over a prefill and O(L) for the 16 tokens that follow a graft. `ReservedLayer`
allocates K and V once per layer with room for the whole forward (the prompt and the tokens to
decode, known before the first chunk), writes each chunk's K/V at its positions and hands attention a
view of the filled positions. Grafted blocks are copied into that room as they are verified (graft.py).

Layout, per layer: buffers K, V of shape [batch, H_kv, capacity, D], contiguous; the layer's `keys` /
`values` are the views [:, :, :S] of the S filled positions (each head's rows stay one run of bytes,
as `graft_op` needs). Attention reads the same values whatever the capacity:
the stride between heads is not something the kernels compute with (tested: logits are equal for
any capacity). Room runs out only when more is appended than was reserved; the layer then doubles
once, copying what it holds.

KV dtype: the layers may keep K/V in a narrower dtype than the model computes in (`kv_dtype`:
bfloat16 under a float32 model, as llama.cpp keeps an F16 KV cache): each chunk's K/V are rounded once
as they are written, and attention reads the rounded values (attention.py widens them exactly). Half
the bytes per block to store, read and hash; another execution profile (`kv_dtype` is a field).

Sliding-window layers keep transformers' own `DynamicSlidingWindowLayer` (they hold a bounded suffix;
a narrower KV dtype is refused for models that have them, runner.py).
"""

from __future__ import annotations

import threading

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer


class ReservedLayer(DynamicLayer):
    """A full-attention layer writing into reserved room; `keys` / `values` view the filled part.

    After `mark_filled(end)` the views are made when next read: a batched step of 16 decode rows
    (engine/batched_step.py) marks 480 layers filled, ~10 us each to slice, and the next step's kernels
    read the buffers through pointers, not the views. `writes` counts every other change of the views
    (a write through `update`, a crop, new buffers: any assignment of `keys` / `values`), so a caller
    that keeps pointers into the buffers knows whether anything else has touched them."""

    def __init__(self, capacity: int = 0, kv_dtype: torch.dtype | None = None, **kwargs):
        self._end: int | None = None  # filled positions whose views are not made yet (mark_filled)
        self.writes = 0
        super().__init__(**kwargs)
        self.capacity = int(capacity)  # positions to reserve at the first write
        self.kv_dtype = kv_dtype  # the dtype K/V are kept in (None: the activations'), rounded once on write
        self.k_buf: torch.Tensor | None = None  # [B, H_kv, capacity, D]
        self.v_buf: torch.Tensor | None = None
        self.whole: torch.Tensor | None = None  # the one tensor every layer's buffers live in (a graft's)

    @property
    def keys(self) -> torch.Tensor | None:
        if self._end is not None:
            self._make_views()
        return self._keys

    @keys.setter
    def keys(self, t: torch.Tensor | None) -> None:
        if self._end is not None:  # the values' pending view first, as it would have been made
            self._make_views()
        self._keys = t
        self.writes += 1

    @property
    def values(self) -> torch.Tensor | None:
        if self._end is not None:
            self._make_views()
        return self._values

    @values.setter
    def values(self, t: torch.Tensor | None) -> None:
        if self._end is not None:
            self._make_views()
        self._values = t
        self.writes += 1

    def _make_views(self) -> None:
        end, self._end = self._end, None
        self._keys, self._values = self.k_buf[:, :, :end], self.v_buf[:, :, :end]

    def get_seq_length(self) -> int:
        if self._end is not None:  # without making the views (create_causal_mask asks every step)
            return self._end
        return super().get_seq_length()

    def with_room(self, room: int) -> ReservedLayer:
        """A new layer holding a copy of this one's filled positions (the same bytes, the same dtype) in
        buffers with room for `room` more, set up as `update` leaves a layer."""
        n = self.get_seq_length()
        out = ReservedLayer(n + room, self.kv_dtype)
        out.device, out.is_initialized = self.keys.device, True  # what DynamicLayer.lazy_initialization sets
        out.keys, out.values = self.keys, self.values  # what _reserve copies into the new buffers
        out._reserve(self.keys, self.values, n, n + room)
        out.filled(n)
        return out

    def make_room(self, tokens: int) -> None:
        """Room for `tokens` more positions in this layer's buffers (moved into larger ones, as `update`
        moves them, where they are short); nothing before the first write."""
        n = self.get_seq_length()
        if self.k_buf is not None and n + tokens > self.k_buf.shape[-2]:
            self._reserve(self.keys, self.values, n, n + tokens)
            self.filled(n)

    def adopt(self, k_buf: torch.Tensor, v_buf: torch.Tensor, length: int, whole: torch.Tensor | None = None) -> None:
        """Take buffers whose first `length` positions are already filled (a graft); `whole` is the
        tensor they are views of, when one holds every layer (graft.py)."""
        self.lazy_initialization(k_buf, v_buf)
        self.k_buf, self.v_buf, self.whole = k_buf, v_buf, whole
        self.keys, self.values = k_buf[:, :, :length], v_buf[:, :, :length]

    def _views_buffers(self) -> bool:
        """Whether keys / values are still the filled prefix of the buffers (a crop keeps that; a
        batch reorder or repeat in DynamicLayer replaces them with new tensors)."""
        if self.k_buf is None:
            return False
        if self.keys.numel() == 0:
            return True
        return all(t.data_ptr() == b.data_ptr() and t.stride() == b.stride() and t.shape[:2] == b.shape[:2]
                   for t, b in ((self.keys, self.k_buf), (self.values, self.v_buf)))

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, n: int, need: int) -> None:
        old = self.k_buf.shape[-2] if self.k_buf is not None else 0
        cap = max(need, self.capacity, 2 * old)
        B, H, _, Dk = key_states.shape
        dtype = self.kv_dtype or key_states.dtype
        k = torch.empty(B, H, cap, Dk, dtype=dtype, device=key_states.device)
        v = torch.empty(B, H, cap, value_states.shape[-1], dtype=dtype, device=value_states.device)
        if n:
            k[:, :, :n].copy_(self.keys)
            v[:, :, :n].copy_(self.values)
        self.k_buf, self.v_buf, self.whole = k, v, None

    def next_position(self, tokens: int, heads: int, head_dim: int, dtype: torch.dtype) -> int | None:
        """Where `update` would write `tokens` more tokens' K/V ([1, heads, tokens, head_dim] in `dtype`)
        without reallocating, for a caller that writes them there itself and then calls `filled` (the
        lean step: models/llama_step.py); None where `update` would do anything else. Before the first
        write the buffers are made here, as `update` makes them at its first write (the lean step
        computes on the CPU), so a prompt's first chunk is written in place like the others."""
        if not self.is_initialized and self.k_buf is None:
            empty = torch.empty(1, heads, 0, head_dim, dtype=dtype)
            self.lazy_initialization(empty, empty)
            self._reserve(empty, empty, 0, tokens)
        if not self.is_initialized or not self._views_buffers():
            return None
        n = self.get_seq_length()
        k, v = self.k_buf, self.v_buf
        if (n + tokens > k.shape[-2] or k.shape[0] != 1 or k.shape[1] != heads or k.shape[3] != head_dim
                or k.dtype != (self.kv_dtype or dtype) or v.shape != k.shape or v.dtype != k.dtype
                or v.stride() != k.stride() or k.stride(3) != 1 or k.stride(2) != head_dim):
            return None
        return n

    def filled(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The views of the first `end` positions, as `update` leaves them, once the caller has written
        the positions up to `end` (see `next_position`)."""
        self.keys, self.values = self.k_buf[:, :, :end], self.v_buf[:, :, :end]
        return self.keys, self.values

    def mark_filled(self, end: int) -> None:
        """As `filled`, the views made when next read (and `writes` left as it is: see the class)."""
        self._end = end

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.get_seq_length()
        end = n + key_states.shape[-2]
        fits = (self._views_buffers() and end <= self.k_buf.shape[-2]
                and self.k_buf.shape[:2] == key_states.shape[:2]
                and self.k_buf.dtype == (self.kv_dtype or key_states.dtype))
        if not fits:
            self._reserve(key_states, value_states, n, end)
        # copy_ rounds to the cache's dtype when it is narrower (round to nearest even, the same bits
        # on every run): attention then reads the rounded K/V, the new rows as the cached ones.
        self.k_buf[:, :, n:end].copy_(key_states)
        self.v_buf[:, :, n:end].copy_(value_states)
        self.keys, self.values = self.k_buf[:, :, :end], self.v_buf[:, :, :end]
        return self.keys, self.values


def new_cache(model: torch.nn.Module, capacity: int = 0, kv_dtype: torch.dtype | None = None) -> DynamicCache:
    """transformers' DynamicCache for `model`, its full-attention layers reserving `capacity` positions
    and keeping K/V in `kv_dtype` (None: the dtype the model computes them in)."""
    cache = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = ReservedLayer(capacity, kv_dtype)
    return cache


def copied(cache: DynamicCache, room: int) -> DynamicCache:
    """A new cache holding a copy of every layer's filled positions (every layer of `cache` a
    ReservedLayer, as `new_cache` makes them), in the same K/V dtype, with room for `room` more
    (score_choices: one per run of choices). Built without walking the model's config again: that walk
    and DynamicLayer's lazy set-up took half of the ~4 ms a copy of SmolLM2's 30 layers took."""
    out = DynamicCache.__new__(DynamicCache)
    Cache.__init__(out, layers=[layer.with_room(room) for layer in cache.layers])  # as DynamicCache(config=)
    return out


class Room:
    """The K/V memory of the last grafted forward, kept for the next one, so a graft reads into
    memory that is already mapped (a fresh 377 MB cache at 8k tokens costs ~90k page faults while the
    blocks are read). One forward holds it at a time: `take` hands it out and forgets it, `give`
    keeps the one a finished forward used. What it keeps is at most the largest cache one forward
    needed (`clear` drops it), as llama.cpp keeps the KV cache of its context."""

    def __init__(self):
        self._lock = threading.Lock()
        self._whole: torch.Tensor | None = None  # [layers, 2, H, room, D]

    def take(self, shape: tuple[int, int, int, int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The kept tensor when it fits `shape` = (layers, 2, H, S, D) with S positions or more (the
        extra room is harmless: attention sees [:S]); else None and the caller allocates."""
        with self._lock:
            whole, self._whole = self._whole, None
        if whole is None or whole.dtype != dtype or whole.device != device:
            return None
        if whole.shape[:3] != shape[:3] or whole.shape[4] != shape[4] or whole.shape[3] < shape[3]:
            return None
        return whole

    def give(self, cache) -> None:
        """Keep the memory of a cache whose forward is over, when all its layers live in one tensor."""
        wholes = [getattr(layer, "whole", None) for layer in getattr(cache, "layers", None) or []]
        if wholes and wholes[0] is not None and all(w is wholes[0] for w in wholes):
            with self._lock:
                self._whole = wholes[0]

    def clear(self) -> None:
        with self._lock:
            self._whole = None
