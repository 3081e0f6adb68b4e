"""The pipelined graft: blocks read and SHA-256-verified on every core into the tier's slots (pinned
host memory on a GPU), each group copied into the cache as soon as it is verified, while later groups
are still being read; verified payloads kept in the verified-once tier (tier.py), so a chain grafted
again is copied without being read or hashed.

One graft (`load_pipelined`; `rows` = the planned chain, catalogue rows in chain order):

1. Hits: the rows whose verified payload the tier holds (leased for this graft).
2. Shapes: the first block's header (the tier's copy, `store.block_meta`, or block 0 read alone)
   shapes the cache (graft._allocate).
3. Misses: each run of consecutive missing blocks is cut into groups (`plan_groups`: 16 SHA-256 lanes
   to a call where the lanes kernel runs, one block with hashlib otherwise). A group gets slots from
   the tier and is read by a reader thread (one per core): `read_blocks_lanes` reads each file into
   the thread's scratch, hashes it there and stores the same bytes into the slot (the bytes cross
   memory once: page cache -> slot), or `read_block` reads into the slot and hashes it there. That
   one copy is the one a verified graft needs: the GPU reads the private slot it was hashed in, which
   nothing else writes, where a file (or its pages) could change between the hash and the copy.
4. Copies. On a GPU the caller's thread walks the chain in order: hits are copied from their slots, a
   group once its read returns; the graft kernel reads the pinned slots in place (one graft_copy launch
   per unit and arena chunk, on `torch.cuda.current_stream`), and an event recorded after the launch
   guards the slots until the copy has finished. On the CPU each reader copies the blocks its group
   verified into the cache rows itself, and hits are copied by the readers too (the cores do the
   copying; there is no link to overlap).
5. The cut. A block that fails (quarantined by the store), or whose header is not the one its chain
   position needs, ends the chain: on a GPU nothing from it or after it is copied; on the CPU rows
   after it may have been written by another reader and are never used (the cache is used up to the
   last verified block, as graft.load_chain does). The blocks before it stand.
6. Verified slots are admitted to the tier within its budget; the others go back to its arenas.

Reads in flight are bounded (`RING_PER_READER` groups per reader), so the slots are the tier's budget
plus that ring. Every byte is hashed on the CPU before any copy of it is launched: no unverified byte
reaches the cache.

Why the CPU hashes and the GPU does not: a block's SHA-256 is one serial chain of 64-byte
compressions, so a GPU could hash only as many messages at once as the chain has blocks (128 at 8k
tokens on an 8B model); the cores hash them at their full rate, a verified chain grafted again comes
from the tier at the link's rate (docs/DESIGN.md, The graft at its floor).
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvmemory.engine import graft
from kvmemory.engine.tier import Held, Slot, VerifiedTier
from kvmemory.errors import IntegrityError

READERS = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
RING_PER_READER = 2  # groups in flight per reader: one being read, one read and waiting for its copy
WAVES = 4  # with per-block hashing (SHA-NI lanes), groups small enough for this many rounds of reads
SEG_MAX = 64 << 10  # segment size for the lanes reader (a divisor of the payload, a multiple of 64)
# On the CPU, whether the readers copy what they verified into the cache rows (step 4). False: the
# caller copies in chain order through the graft op, as on a GPU (the tests run the GPU's order here).
CPU_READERS_COPY = True

_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, threads, readers)
_pool_lock = threading.Lock()
_staging_tiers: dict[str, VerifiedTier] = {}  # budget-0 tiers: slots for callers that pass no tier


def readers() -> ThreadPoolExecutor:
    """The pipeline's reader threads (one per core), started once per process (and again after a fork)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid() or _pool[1] != READERS:
            _pool = (os.getpid(), READERS, ThreadPoolExecutor(READERS, thread_name_prefix="kvmemory-pipe"))
        return _pool[2]


def staging_tier(device: torch.device) -> VerifiedTier:
    """A tier that keeps nothing, for a caller without one: its arenas are the graft's staging."""
    where = "pinned" if device.type == "cuda" else "cpu"
    with _pool_lock:
        tier = _staging_tiers.get(where)
        if tier is None:
            tier = _staging_tiers[where] = VerifiedTier(0, where)
        return tier


def lanes_build() -> str | None:
    """The SHA-256 lanes build that runs here ("avx512", "sha-ni"), or None (hashlib, a block at a time)."""
    from kvmemory.kernels import sha256_lanes

    return sha256_lanes.kind() if sha256_lanes.load() is not None else None


def plan_groups(run: Sequence[int], threads: int, build: str | None) -> list[list[int]]:
    """A run of consecutive missing blocks cut into the readers' work items, in chain order.

    "avx512": 16 blocks share each instruction, so groups are as close to 16 as the readers allow
    (`sha256_lanes.groups`: at least one group per reader, at least `fewest_lanes` blocks each, else
    fewer, larger groups); "sha-ni": each lane is hashed on its own, so smaller groups cost nothing
    and give the copies more rounds to overlap (`WAVES` per reader); None: one block per item."""
    from kvmemory.kernels import sha256_lanes

    run = list(run)
    if not run:
        return []
    if build == "avx512":
        groups = sha256_lanes.groups(run, threads, sha256_lanes._FEWEST["avx512"])
        if groups is None and len(run) >= sha256_lanes._FEWEST["avx512"]:
            groups = sha256_lanes.groups(run, len(run) // sha256_lanes._FEWEST["avx512"],
                                         sha256_lanes._FEWEST["avx512"])
        if groups:
            return groups
    elif build is not None:
        size = min(sha256_lanes.LANES, max(1, math.ceil(len(run) / (max(1, threads) * WAVES))))
        return [run[i : i + size] for i in range(0, len(run), size)]
    return [[i] for i in run]


def segment_bytes(nbytes: int) -> int | None:
    """The lanes reader's segment size for a payload of `nbytes`: a multiple of 64 dividing it, at most
    SEG_MAX; None when the payload is not a multiple of 64 (then hashlib reads it)."""
    if nbytes <= 0 or nbytes % 64:
        return None
    return 64 * math.gcd(nbytes // 64, SEG_MAX // 64)


@dataclass(slots=True, eq=False)
class _Unit:
    """Consecutive blocks of the chain handled together: tier hits, or a group read by one reader."""

    idxs: list[int]
    slots: list[Slot]
    hit: bool
    lanes: bool = False  # read with the SHA-256 lanes reader (else read_block, hashlib)
    future: Future | None = None
    results: list | None = None  # per block: BlockMeta (verified) or the exception it failed with
    copied: int = 0  # blocks a CPU reader copied into the cache (a prefix of the unit)
    released: bool = False


def _read_group(store, rows, unit: _Unit, lanes: bool, copy=None) -> list:
    """Read and verify the unit's blocks into its slots; with `copy` (CPU), copy the verified prefix
    into the cache rows right away. Runs in a reader thread."""
    group = [rows[i] for i in unit.idxs]
    if lanes:
        seg = segment_bytes(group[0].payload_nbytes)
        segs = {r.hash: np.arange(s.nbytes // seg, dtype=np.uint64) * np.uint64(seg) + np.uint64(s.address())
                for r, s in zip(group, unit.slots)}

        def place(meta):
            where = segs.get(meta.hash)
            if where is None:  # read_blocks_lanes checked the header against this row: cannot happen
                raise IntegrityError(f"block {meta.hash[:12]} has no slot in this read")
            return where, seg

        results = store.read_blocks_lanes(group, place)
    else:
        results = []
        for r, s in zip(group, unit.slots):
            try:
                meta, _ = store.read_block(r, into=memoryview(s.tensor().numpy()))
            except IntegrityError as exc:
                results.append(exc)
            else:
                results.append(meta)
    if copy is not None:
        for i, slot, res in zip(unit.idxs, unit.slots, results):
            if isinstance(res, Exception) or not copy(i, slot, res):
                break
            unit.copied += 1
    return results


def load_chain(store, rows, report, runner=None, capacity: int = 0, room=None, tier: VerifiedTier | None = None):
    """The engine's way to load a chain: through the pipeline on a GPU, and on the CPU for a chain the
    tier wants (`VerifiedTier.wants`: a tier with a budget, a chain grafted before); else
    graft.load_chain (the CPU's direct read into the cache)."""
    if runner is not None and rows and (runner.device.type == "cuda" or (tier is not None and tier.wants(rows))):
        return load_pipelined(store, rows, report, runner, capacity, room, tier)
    return graft.load_chain(store, rows, report, runner=runner, capacity=capacity, room=room)


def load_pipelined(store, rows, report, runner, capacity: int = 0, room=None, tier: VerifiedTier | None = None):
    """Read, verify and place the chain `rows` as the module docstring says; returns graft.LoadedChain
    whose `cache` holds the verified blocks (cut at the first one that failed)."""
    LoadedChain, _allocate, _copy_into_whole, _layout = (graft.LoadedChain, graft._allocate,
                                                          graft._copy_into_whole, graft._layout)
    t0 = time.perf_counter()
    device = runner.device
    tier = tier if tier is not None else staging_tier(device)
    tier.begin()
    rows = list(rows)
    n = len(rows)
    held: list[Held | None] = [tier.lookup(r) for r in rows]  # each hit leased once
    units: list[_Unit] = []
    in_flight: list[_Unit] = []
    metas: list = []  # the verified blocks, in chain order, up to the cut
    from_tier = 0
    dst = first = None
    cut: tuple[int, Exception, bool] | None = None  # (chain index, why, quarantined by the store)
    event = None  # the last copy's CUDA event (stream order: it follows every earlier copy)
    try:
        # -- the first block's header shapes the cache
        if n and held[0] is not None:
            first = held[0].meta
        elif n and hasattr(store, "block_meta"):
            try:
                first = store.block_meta(rows[0])
            except IntegrityError as exc:
                cut = (0, exc, True)
        elif n:  # no header-only read: block 0 is read alone first
            u0 = _Unit([0], [tier.acquire(rows[0].payload_nbytes)], False)
            units.append(u0)
            u0.results = _read_group(store, rows, u0, False)
            if isinstance(u0.results[0], Exception):
                cut = (0, u0.results[0], True)
            else:
                first = u0.results[0]
        starts = _starts(rows)  # where each block's positions begin: the chain's chunks, in order
        if first is not None:
            dst = _allocate(runner, first, starts[-1] + rows[-1].n_tokens, capacity, room)
            units += _units(rows, held, 1 if units else 0, store)
        in_readers = (CPU_READERS_COPY and device.type != "cuda" and dst is not None
                      and dst.whole is not None)  # step 4, CPU
        keep_slots = dst is not None and dst.whole is None  # a cut copies again from them (sliding layers)

        def fits(i: int, meta) -> bool:
            """Whether a verified header is the one chain position i needs (same layout, own position)."""
            return _layout(meta) == _layout(first) and meta.position == starts[i] \
                and meta.n_tokens == rows[i].n_tokens

        def copy_one(i: int, slot: Slot, meta) -> bool:  # a CPU reader: into the one-tensor cache's rows
            if not fits(i, meta):
                return False
            _copy_into_whole(memoryview(slot.tensor().numpy()), meta, dst)
            return True

        pool = readers()
        ring = RING_PER_READER * READERS
        submitted = len(units) if cut is not None else (1 if units and units[0].results is not None else 0)

        def submit(upto: int) -> None:
            """Start the units up to `upto`, and more while the ring has room."""
            nonlocal submitted
            while submitted < len(units) and (submitted <= upto or len(in_flight) < ring):
                u = units[submitted]
                submitted += 1
                if u.hit:
                    if in_readers:
                        u.future = pool.submit(_copy_hits, u, held, copy_one)
                        in_flight.append(u)
                    continue
                for k_ in u.idxs:  # one at a time: if an allocation fails, the slots taken are released
                    u.slots.append(tier.acquire(rows[k_].payload_nbytes))
                u.future = pool.submit(_read_group, store, rows, u, u.lanes, copy_one if in_readers else None)
                in_flight.append(u)

        # -- the consumer: the chain in order
        for k, u in enumerate(units):
            if cut is not None:
                break
            submit(k)
            if u.future is not None:
                got = u.future.result()
                in_flight.remove(u)
                if not u.hit:
                    u.results = got
            elif in_readers and not u.hit:  # block 0, read alone before the cache existed: copy it here
                for i, slot, res in zip(u.idxs, u.slots, u.results):
                    if isinstance(res, Exception) or not copy_one(i, slot, res):
                        break
                    u.copied += 1
            good: list[tuple[int, Slot, object]] = []
            for pos, (i, slot) in enumerate(zip(u.idxs, u.slots)):
                res = held[i].meta if u.hit else u.results[pos]
                if isinstance(res, Exception):
                    cut = (i, res, True)
                    break
                if not fits(i, res) or (in_readers and pos >= u.copied):
                    cut = (i, IntegrityError(f"its header is laid out unlike the chain's first block or claims "
                                             f"position {res.position}, not {starts[i]}"), False)
                    break
                good.append((i, slot, res))
            if good and not in_readers:
                event = _launch(good, dst, device, _copy_into_whole)
            for i, slot, meta in good:
                metas.append(meta)
                if u.hit:
                    from_tier += 1
                else:
                    tier.admit(meta, slot)
            if not keep_slots:
                _release(tier, u, event)
        # -- a cut when the layers are not one tensor: a cache for the shorter chain, copied again
        if keep_slots and metas and len(metas) < n:
            dst = _allocate(runner, first, sum(m.n_tokens for m in metas), capacity)
            slot_of = {i: s for u in units for i, s in zip(u.idxs, u.slots)}
            event = _launch([(i, slot_of[i], m) for i, m in enumerate(metas)], dst, device, _copy_into_whole)
    finally:
        for u in in_flight:  # reads still running write into this graft's slots: wait for them
            if not u.future.cancel():
                try:
                    u.future.result()
                except Exception:
                    pass
        for u in units:
            _release(tier, u, event)
        taken = {i for u in units if u.hit for i in u.idxs}
        for i, h in enumerate(held):  # hits no unit took (the first block failed): their leases end here
            if h is not None and i not in taken:
                tier.release(h.slot)
    if cut is not None:
        i, why, quarantined = cut
        r = rows[i]
        if quarantined:
            report.quarantined.append(r.hash)
            report.fallback = (f"block {r.index} ({r.hash[:12]}) failed verification and was quarantined: {why}; "
                               "recomputed from that point")
        else:
            report.fallback = f"block {r.index} ({r.hash[:12]}) was refused: {why}; recomputed from that point"
    report.bytes_read += sum(m.payload_nbytes for m in metas)
    report.blocks_from_tier += from_tier
    report.read_verify_seconds += time.perf_counter() - t0
    store.touch_blocks([m.hash for m in metas])
    report.blocks_used = [m.hash for m in metas]
    chain = LoadedChain(metas=metas, staging=None, offsets=[])
    if metas:
        chain.cache = dataclasses.replace(dst, end=metas[-1].position + metas[-1].n_tokens)
    return chain


def _starts(rows) -> list[int]:
    """The first position of each block of a chain from position 0 (the sum of the blocks' before it)."""
    out, pos = [], 0
    for r in rows:
        out.append(pos)
        pos += r.n_tokens
    return out


def _units(rows, held, start: int, store) -> list[_Unit]:
    """The chain from `start` as units, in chain order: each run of tier hits one unit, each run of
    misses cut into read groups (`plan_groups`)."""
    build = lanes_build() if hasattr(store, "read_blocks_lanes") else None
    units, n, i = [], len(rows), start
    while i < n:
        j = i
        hit = held[i] is not None
        # a run of misses holds blocks of one payload size (the lanes hash equal messages): a tail
        # block (cut short: runner.chunk_spans) is read in a run of its own
        while j < n and (held[j] is not None) == hit and (hit or rows[j].payload_nbytes == rows[i].payload_nbytes):
            j += 1
        if hit:
            units.append(_Unit(list(range(i, j)), [held[k].slot for k in range(i, j)], True))
        else:
            size = rows[i].payload_nbytes
            lanes = build is not None and segment_bytes(size) is not None and all(
                rows[k].payload_nbytes == size for k in range(i, j))
            for g in plan_groups(range(i, j), READERS, build if lanes else None):
                units.append(_Unit(g, [], False, lanes=lanes and (len(g) > 1 or build == "sha-ni")))
        i = j
    return units


def _copy_hits(unit: _Unit, held, copy_one) -> list:
    """A CPU reader copies a run of tier hits into the cache rows (they were verified when admitted)."""
    for i, slot in zip(unit.idxs, unit.slots):
        if not copy_one(i, slot, held[i].meta):
            break
        unit.copied += 1
    return []


def _launch(good, dst, device: torch.device, copy_into_whole):
    """Copy verified blocks [(chain index, slot, meta)] into the cache: the graft op, one call per arena
    chunk (the kernel on a GPU: asynchronous on the current stream; the event recorded after it is
    returned), or on the CPU into the one-tensor cache rows."""
    from kvmemory.kernels.graft_op import graft_copy

    if device.type != "cuda" and dst.whole is not None and CPU_READERS_COPY:
        for _, slot, meta in good:
            copy_into_whole(memoryview(slot.tensor().numpy()), meta, dst)
        return None
    by_chunk: dict[int, tuple[torch.Tensor, list]] = {}
    for _, slot, meta in good:
        by_chunk.setdefault(id(slot.chunk), (slot.chunk, []))[1].append((slot.offset, meta))
    for chunk, items in by_chunk.values():
        graft_copy(chunk, [o for o, _ in items], [m.position for _, m in items], [m.n_tokens for _, m in items],
                   dst.keys, dst.values, dst.offsets)
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _release(tier: VerifiedTier, unit: _Unit, event) -> None:
    if unit.released:
        return
    unit.released = True
    for slot in unit.slots:
        tier.release(slot, event)
