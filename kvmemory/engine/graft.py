"""Grafting: find the longest stored chain for a token sequence, load and verify it, place it in a cache.

The chain is looked up by chain hash (store/blocks.py), so only blocks computed after exactly the same
tokens, under the same profile, at the same positions can be found. Blocks are read in parallel,
each hashed where it was read (SHA-256 against the catalogue) and only then copied to its positions
of the cache (`load_chain` says how, per device). A damaged block is quarantined by the store and the
chain is cut before it: the rest is recomputed, never guessed.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from kvmemory.store.blocks import DTYPES, BlockMeta, chain_hashes, span_hashes
from kvmemory.errors import IntegrityError, NotOnGrid, UnsupportedArchitecture
from kvmemory.store.local import BlockRow

_READ_THREADS = max(1, min(8, os.cpu_count() or 1))
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid, readers), started once per process
_pool_lock = threading.Lock()
_reader = threading.local()  # per reader thread: the buffer it reads blocks into (kept: it stays in cache)


def _readers() -> ThreadPoolExecutor:
    """The reader threads, started once: a short graft should not pay for starting threads. A forked
    child gets its own (the parent's threads do not exist there)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="kvmemory-read"))
        return _pool[1]


def _reader_buffer(nbytes: int) -> memoryview:
    buf = getattr(_reader, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _reader.buf = memoryview(bytearray(nbytes))
    return buf[:nbytes]


@dataclass(slots=True)
class GraftReport:
    """What a graft did: where the tokens came from, what was read and how long verifying took."""

    tokens_total: int = 0
    tokens_grafted: int = 0
    tokens_computed: int = 0
    tokens_decoded: int = 0
    tokens_scored: int = 0  # tokens computed only to score choices (the choices; the question alone when contrasted)
    bytes_read: int = 0
    read_verify_seconds: float = 0.0
    copy_seconds: float = 0.0
    compute_seconds: float = 0.0
    decode_seconds: float = 0.0
    blocks_used: list[str] = field(default_factory=list)
    entries_used: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    fallback: str | None = None  # why less than the stored chain was grafted, if it was
    blocks_stored: int = 0
    blocks_from_tier: int = 0  # of blocks_used: copied from the verified-once tier, not read (tier.py)

    def to_json(self) -> dict:
        return {
            "tokens_total": self.tokens_total,
            "tokens_grafted": self.tokens_grafted,
            "tokens_computed": self.tokens_computed,
            "tokens_decoded": self.tokens_decoded,
            "tokens_scored": self.tokens_scored,
            "bytes_read": self.bytes_read,
            "read_verify_seconds": round(self.read_verify_seconds, 6),
            "copy_seconds": round(self.copy_seconds, 6),
            "compute_seconds": round(self.compute_seconds, 6),
            "decode_seconds": round(self.decode_seconds, 6),
            "blocks_used": len(self.blocks_used),
            "entries_used": list(self.entries_used),
            "quarantined": list(self.quarantined),
            "fallback": self.fallback,
            "blocks_stored": self.blocks_stored,
            "blocks_from_tier": self.blocks_from_tier,
        }


def graft_spans(n_tokens: int, chunk: int, cuts: Sequence[int] = ()) -> list[tuple[int, int]]:
    """The chunks of an n-token prompt a graft may take from the store: every chunk but the last (at
    least the last prompt token is always recomputed: its logits start the decode), each ending on the
    grid or at a cut (runner.chunk_spans)."""
    from kvmemory.engine.runner import chunk_spans

    return chunk_spans(0, n_tokens, chunk, cuts)[:-1] if n_tokens > 0 else []


def plan_chain(store, profile_id: str, token_ids: Sequence[int], chunk: int, cuts: Sequence[int] = ()) -> list[BlockRow]:
    """The longest run of stored blocks from position 0 over `graft_spans`: without cuts, at most
    floor((n-1)/C) whole blocks; with cuts, the chunks they end too (a tail block)."""
    if cuts:
        hashes = span_hashes(profile_id, token_ids, graft_spans(len(token_ids), chunk, cuts))
    else:
        hashes = list(chain_hashes(profile_id, token_ids, chunk, limit=len(token_ids) - 1))
    known = store.known_blocks(hashes)  # one lookup for the chain, not one per block
    rows: list[BlockRow] = []
    for h in hashes:
        if h not in known:
            break
        rows.append(known[h])
    return rows


@dataclass(slots=True)
class LoadedChain:
    metas: list[BlockMeta]
    staging: torch.Tensor  # uint8 [sum of payloads], payload i at offsets[i] (verified)
    offsets: list[int]
    cache: object | None = None  # a cache already holding the chain, when built while loading


def _staging(nbytes: int, device: torch.device) -> torch.Tensor:
    """Host staging for the payloads: pinned when they go to a GPU (the kernel reads it in place)."""
    if device.type == "cuda":
        from kvmemory.kernels.graft_op import pinned_staging

        return pinned_staging(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8)


def load_chain(store, rows: Sequence[BlockRow], report: GraftReport, runner=None, capacity: int = 0,
               room=None) -> LoadedChain:
    """Read and verify `rows`; cut the chain at the first damaged block.

    (The engine goes through pipeline.load_chain: on a GPU, and on the CPU for a chain the
    verified-once tier wants, the pipeline reads, verifies and copies instead; everything else comes
    here.)

    With a `runner`, the cache is built while loading, with room for `capacity` positions (in
    `room`'s kept buffers when they fit, see cache.Room). On the CPU, when every layer is a
    full-attention layer with the same K/V shapes, the cache is one tensor [layers, K|V, H, S, D]
    and a block's payload is exactly its rows [:, :, :, p:p+C]; a local store's first header gives
    its shape, and then every block is read by the reader threads into place: on CPUs
    with AVX-512 or the SHA extensions in groups of up to 16 blocks, read a slab of rows at a time,
    hashed and stored into their rows (`LocalStore.read_blocks_lanes`, sha256_lanes.py: 16 at a time in
    AVX-512's lanes, or each by the SHA instructions), elsewhere (or with too few blocks per
    thread) one at a time into the thread's own small buffer (reused, so it stays in cache), hashed
    there with one call and copied into place with one more — two calls that release the GIL per
    block, where reading straight into the 180 per-head rows of SmolLM2 with hashlib took one hash
    call (and one GIL hand-over) per row and ran at 60 % of the speed. Otherwise (sliding-window
    layers, a store without local files) the first block is read alone for its
    shapes, then each worker reads a block into its slice of one staging buffer (pinned on a GPU),
    hashes it there and, once verified, copies it to its positions with `graft_op.graft_copy`.
    Either way the threads overlap reading, hashing and copying, and a cache built from a chain cut
    short is used only up to the last verified block.
    """
    offsets, total = [], 0
    for r in rows:
        offsets.append(total)
        total += r.payload_nbytes
    # Where each block's positions begin (the chain's chunks in order: a tail block at a cut is shorter),
    # checked against every header before a byte is placed.
    starts, end = {}, 0
    for r in rows:
        starts[r.hash] = end
        end += r.n_tokens
    device = runner.device if runner is not None else torch.device("cpu")
    t0 = time.perf_counter()
    results: list = []
    dst = None
    staging = None
    into_whole = False
    # Where one cache tensor may hold every layer, blocks are read through the reader threads' own
    # buffers and copied into it; a GPU keeps the pinned staging buffer the kernel reads.
    may_whole = runner is not None and device.type == "cpu" and runner.full_attention_only
    start = 1  # the first block the threads read (block 0 is read alone first, unless its header sufficed)
    if rows and may_whole and hasattr(store, "block_meta"):
        # The first block's header alone gives the shapes the cache is allocated with: every block,
        # the first included, is then read by the threads, straight into the cache.
        try:
            first = store.block_meta(rows[0])
        except IntegrityError as exc:
            results.append(exc)  # the chain ends before it: nothing else is read
            start = len(rows)
        else:
            dst = _allocate(runner, first, end, capacity, room)
            into_whole = dst.whole is not None
            if into_whole:
                start = 0
            else:
                dst = None  # layers of unequal shapes: read block 0 first, as below
    if rows and start == 1:
        # The first block's header gives the shapes the cache is allocated with. It is read like
        # the others: into this thread's reader buffer, or into its slice of the one staging buffer
        # (pinned on a GPU), allocated once.
        n0 = rows[0].payload_nbytes
        if may_whole:
            first_buf = _reader_buffer(n0)
        else:
            staging = _staging(total, device)
            first_buf = memoryview(staging.numpy())[:n0]
        first = _read(store, rows[0], first_buf)
        results.append(first)
        if runner is not None and not isinstance(first, Exception):
            if first.position != 0:
                first = IntegrityError(f"block {rows[0].hash[:12]} claims position {first.position}, not 0")
                results[0] = first
            else:
                dst = _allocate(runner, first, end, capacity, room)
        into_whole = may_whole and dst is not None and dst.whole is not None
        if into_whole:
            _copy_into_whole(first_buf, first, dst)
        else:
            if may_whole:  # layers of unequal shapes (or a damaged first block): stage the chain after all
                staging = _staging(total, device)
                staging[:n0].copy_(torch.frombuffer(first_buf, dtype=torch.uint8))
            if dst is not None:
                _copy_blocks(staging, [0], [first], dst)
    view = memoryview(staging.numpy()) if staging is not None and not into_whole and total else None

    def read(i: int):
        r = rows[i]
        if into_whole:
            buf = _reader_buffer(r.payload_nbytes)
            meta = _read(store, r, buf)
            if isinstance(meta, Exception):
                return meta
            if _layout(meta) != _layout(first):  # the cache was shaped on the first block
                return IntegrityError(f"block {r.hash[:12]} is laid out unlike the chain's first block")
            if meta.position != starts[r.hash]:
                return IntegrityError(f"block {r.hash[:12]} claims position {meta.position}, not {starts[r.hash]}")
            _copy_into_whole(buf, meta, dst)
            return meta
        meta = _read(store, r, view[offsets[i] : offsets[i] + r.payload_nbytes])
        if not isinstance(meta, Exception) and meta.position != starts[r.hash]:
            return IntegrityError(f"block {r.hash[:12]} claims position {meta.position}, not {starts[r.hash]}")
        if dst is not None and not isinstance(meta, Exception):
            _copy_blocks(staging, [offsets[i]], [meta], dst)
        return meta

    def place(meta: BlockMeta):
        """Where a block's payload goes in the one-tensor cache: its rows, one per (layer, K|V, head)."""
        if _layout(meta) != _layout(first):
            raise IntegrityError(f"block {meta.hash[:12]} is laid out unlike the chain's first block")
        if meta.position != starts.get(meta.hash):  # raw addresses: only its own rows of the cache
            raise IntegrityError(f"block {meta.hash[:12]} claims position {meta.position}, not {starts.get(meta.hash)}")
        if not 0 <= meta.position <= dst.whole.shape[3] - meta.n_tokens:  # never past the cache
            raise IntegrityError(f"block {meta.hash[:12]} claims position {meta.position}, outside this chain's cache")
        return dst.row_addresses + meta.position * dst.position_bytes, meta.n_tokens * dst.position_bytes

    def read_group(group: list[int]) -> list:
        if len(group) > 1:  # 16 blocks to a call, hashed in the lanes of one register
            return store.read_blocks_lanes([rows[i] for i in group], place)
        return [read(group[0])]

    groups = _groups(start, rows, into_whole and hasattr(store, "read_blocks_lanes"),
                     dst.position_bytes if into_whole else 0)
    if len(groups) > 1 and _READ_THREADS > 1:
        results += [m for done in _readers().map(read_group, groups) for m in done]
    else:
        results += [m for g in groups for m in read_group(g)]
    metas: list[BlockMeta] = []
    for r, res in zip(rows, results):
        if isinstance(res, Exception):
            report.quarantined.append(r.hash)
            report.fallback = f"block {r.index} ({r.hash[:12]}) failed verification and was quarantined: {res}; " \
                              "recomputed from that point"
            break
        metas.append(res)
        report.bytes_read += r.payload_nbytes
    report.read_verify_seconds += time.perf_counter() - t0
    store.touch_blocks([m.hash for m in metas])
    report.blocks_used = [m.hash for m in metas]
    chain = LoadedChain(metas=metas, staging=None if into_whole else staging, offsets=offsets[: len(metas)])
    if dst is not None and len(metas) == len(rows):
        chain.cache = dst  # complete: the cache was built while loading
    elif into_whole and metas:  # cut: only the verified positions are used (build_cache views [:end])
        chain.cache = dataclasses.replace(dst, end=metas[-1].position + metas[-1].n_tokens)
    return chain


def _groups(start: int, rows: Sequence[BlockRow], lanes: bool, position_bytes: int = 0) -> list[list[int]]:
    """Blocks start.. as the reader threads' work items, in chain order: with `lanes` (and the library),
    each run of blocks of one length whose rows are 64-byte multiples in groups for `sha256_lanes`
    (`sha256_lanes.groups`: it hashes equal messages), else one block each (a tail block, cut short at a
    cut, is read on its own)."""
    from kvmemory.kernels import sha256_lanes

    lanes = lanes and sha256_lanes.load() is not None
    out: list[list[int]] = []
    i, n = start, len(rows)
    while i < n:
        j = i
        while j < n and rows[j].n_tokens == rows[i].n_tokens:
            j += 1
        run = list(range(i, j))
        grouped = (sha256_lanes.groups(run, _READ_THREADS)
                   if lanes and (position_bytes * rows[i].n_tokens) % 64 == 0 else None)
        out += grouped or [[k] for k in run]
        i = j
    return out


def _read(store, row: BlockRow, into):
    try:
        meta, _ = store.read_block(row, into=into)
    except IntegrityError as exc:
        return exc
    return meta


def _layout(m: BlockMeta) -> tuple:
    """What must be alike in every block of a chain: dtype and per-layer heads and head dims (not the
    token count: a tail block at a cut is shorter)."""
    return m.dtype, tuple((h, d) for h, _, d in m.k_shapes), tuple((h, d) for h, _, d in m.v_shapes)


def _copy_into_whole(payload: memoryview, meta: BlockMeta, dst: "_Dest") -> None:
    """Copy a verified payload (per layer: K heads then V heads, each [C, D]) to its rows of the
    one-tensor cache [layers, 2, H, S, D], as bytes (numpy releases the GIL and converts nothing)."""
    rows = dst.whole_bytes[:, :, :, meta.position : meta.position + meta.n_tokens]
    np.copyto(rows, np.frombuffer(payload, dtype=np.uint8).reshape(rows.shape))


def check_chain(metas: Sequence[BlockMeta], token_ids: Sequence[int], chunk: int, start: int = 0,
                cuts: Sequence[int] = ()) -> int:
    """Check that `metas` form one chain placed at their own positions from `start`; returns the end.

    Exact mode refuses a block anywhere but where it was computed: a graft that starts elsewhere
    than position 0, a block that is not the chunk the runner computes there (the grid's, or one a
    cut ends: runner.chunk_spans), a gap in the chain, or tokens that differ.
    """
    from kvmemory.engine.runner import chunk_spans, span_boundary

    if not span_boundary(start, chunk, cuts):
        raise NotOnGrid(f"graft point {start} is neither a multiple of the grid C={chunk} nor a cut")
    spans = [sp for sp in chunk_spans(0, len(token_ids), chunk, cuts) if sp[0] >= start]
    pos = start
    parent = None
    for i, m in enumerate(metas):
        if m.position != pos:
            raise NotOnGrid(
                f"block {m.hash[:12]} was computed at position {m.position} and cannot be grafted at {pos}: "
                "KV are stored after RoPE, so a shifted graft would not be exact (refused in exact mode)"
            )
        if i >= len(spans) or spans[i] != (m.position, m.position + m.n_tokens):
            raise NotOnGrid(f"block {m.hash[:12]} (positions {m.position}..{m.position + m.n_tokens}) is not a "
                            f"chunk of this prompt on the grid C={chunk}{' with cuts ' + str(list(cuts)) if cuts else ''}")
        if i and m.parent != parent:
            raise NotOnGrid(f"block {m.hash[:12]} does not follow block {parent[:12]}: the chain has a gap")
        if tuple(token_ids[pos : pos + m.n_tokens]) != m.token_ids:
            raise NotOnGrid(f"block {m.hash[:12]} was computed for other tokens than positions {pos}..{pos + m.n_tokens}")
        parent = m.hash
        pos += m.n_tokens
    if metas and metas[0].parent is not None:
        raise NotOnGrid("the first grafted block must start the chain (position 0)")
    return pos


@dataclass(slots=True)
class _Dest:
    """Per-layer cache tensors being filled, and where the chain ends."""

    end: int
    keys: list[torch.Tensor]  # per layer [1, H, room, D]: positions [offset, offset + room) of which < end are filled
    values: list[torch.Tensor]
    offsets: list[int]  # first absolute position each layer holds (sliding layers keep a suffix)
    whole: torch.Tensor | None = None  # [layers, 2, H, room, D]: keys[l] = whole[l, 0], values[l] = whole[l, 1]
    whole_bytes: object = None  # `whole` as a numpy uint8 array [layers, 2, H, room, D * itemsize], no copy

    row_addresses: object = None  # uint64 [layers * 2 * H]: where each (layer, K|V, head) row of `whole` starts
    position_bytes: int = 0  # bytes of one position in a row (D * itemsize)

    def __post_init__(self):
        if self.whole is not None and self.whole.device.type == "cpu":
            self.whole_bytes = self.whole.view(torch.uint8).numpy().reshape(*self.whole.shape[:4], -1)
            rows, room, self.position_bytes = int(np.prod(self.whole.shape[:3])), self.whole.shape[3], self.whole_bytes.shape[4]
            self.row_addresses = self.whole.data_ptr() + np.arange(rows, dtype=np.uint64) * np.uint64(room * self.position_bytes)


def _allocate(runner, m0: BlockMeta, end: int, capacity: int = 0, room=None) -> _Dest:
    """Cache buffers for positions [0, end), shaped as the model's cache layers hold them: full
    attention layers get room for `capacity` positions (the whole forward, cache.py), sliding-window
    layers exactly what they keep. With a `cache.Room`, its kept buffers are used when large enough."""
    dtype = DTYPES[m0.dtype]
    if dtype != runner.kv_dtype:
        raise UnsupportedArchitecture(f"blocks hold {m0.dtype} K/V but the runner's cache keeps {runner.kv_dtype}")
    windows = runner.sliding_windows
    if len(m0.k_shapes) != len(windows):
        raise UnsupportedArchitecture(f"blocks hold {len(m0.k_shapes)} layers, the model has {len(windows)}")
    if runner.full_attention_only and len(set(m0.k_shapes) | set(m0.v_shapes)) == 1:
        # Every layer alike: one tensor holds them all, so a block's payload is one slice of it.
        (h, _, d), need = m0.k_shapes[0], max(end, capacity)
        whole = room.take((len(windows), 2, h, need, d), dtype, runner.device) if room is not None else None
        if whole is None:
            whole = torch.empty(len(windows), 2, h, need, d, dtype=dtype, device=runner.device)
        return _Dest(end, [w[0].unsqueeze(0) for w in whole], [w[1].unsqueeze(0) for w in whole],
                     [0] * len(windows), whole)
    keys, values, offs = [], [], []
    for window, (kh, _, kd), (vh, _, vd) in zip(windows, m0.k_shapes, m0.v_shapes):
        if window is None:
            keep = max(end, capacity)
        else:  # sliding window: what the layer itself would hold after `end` tokens
            keep = min(end, window - 1)
        keys.append(torch.empty(1, kh, keep, kd, dtype=dtype, device=runner.device))
        values.append(torch.empty(1, vh, keep, vd, dtype=dtype, device=runner.device))
        offs.append(end - keep if keep < end else 0)
    return _Dest(end, keys, values, offs)


def _copy_blocks(staging: torch.Tensor, offsets: Sequence[int], metas: Sequence[BlockMeta], dst: _Dest) -> None:
    from kvmemory.kernels.graft_op import graft_copy

    graft_copy(staging, list(offsets), [m.position for m in metas], [m.n_tokens for m in metas],
               dst.keys, dst.values, dst.offsets)


def build_cache(runner, chain: LoadedChain, report: GraftReport, capacity: int = 0):
    """A transformers cache holding the chain's K/V at their own positions (positions < end), with
    room for `capacity` positions in its full-attention layers."""
    from kvmemory.engine.cache import ReservedLayer

    cache = runner.new_cache(capacity)
    metas = chain.metas
    if not metas:
        return cache
    t0 = time.perf_counter()
    dst = chain.cache
    end = metas[-1].position + metas[-1].n_tokens
    if dst is None or dst.end != end:  # not built while loading (or the chain was cut): copy now
        dst = _allocate(runner, metas[0], end, capacity)
        _copy_blocks(chain.staging, chain.offsets, metas, dst)
    if runner.device.type == "cuda":
        torch.cuda.current_stream(runner.device).synchronize()  # copies may have run on worker threads
    for layer, k, v, off in zip(cache.layers, dst.keys, dst.values, dst.offsets):
        if isinstance(layer, ReservedLayer):
            layer.adopt(k, v, end, dst.whole)
        else:  # a sliding-window layer holds positions [off, end)
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k[:, :, : end - off], v[:, :, : end - off]
            layer.cumulative_length = end
    report.copy_seconds += time.perf_counter() - t0
    return cache
