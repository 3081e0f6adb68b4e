"""The verified-once tier: block payloads kept in memory after they were verified, so a chain grafted
again is copied into the cache without being read or hashed again.

Where the bytes live: pinned host memory when the engine runs on a GPU (the graft kernel reads them
over the link in place), plain RAM on the CPU. They live in slots of arenas (`Arena`: one per payload
size, chunks of equal slots allocated as needed), and the same slots serve as the staging a graft
reads blocks into (pipeline.py): a block read for a graft lands in a slot, is hashed, copied to the
cache from there, and the slot is kept as the block's tier copy. Entering the tier costs no pass over
the bytes beyond the read itself.

Trust — why serving a block from here is as safe as reading and hashing its file:

- A slot's bytes enter the tier only once they were hashed (SHA-256) and found equal to the payload
  SHA-256 of the block's catalogue row: the reader hashes exactly the bytes it leaves in the slot
  (`sha256_lanes` stores the bytes it hashed; `read_block` hashes the slot in place). They are kept
  under the block hash together with that digest.
- A block is served from here only for a catalogue row the store returned for the graft being made
  (plan_chain: present, visible to this reader — a signed store checks its signature —, not
  quarantined), with the same payload SHA-256, and whose other fields (parent, index, tokens,
  profile, size) equal the header kept with the bytes, which was checked in full against the
  catalogue when the block was read. A block quarantined, forgotten or rewritten in the store — by
  this process or another one — is therefore not served from here: its row is gone or differs.
- A quarantine, a delete or an eviction in this process also drops the block at once (store/drops.py),
  so its bytes do not stay in memory.
- The tier is this process's memory, nothing else: no file, no shared memory. Whoever can write it can
  write the model's weights as well.
- A slot's bytes are written only by a read into a slot handed out for that read; a slot the tier
  holds, or one leased to a graft, is never handed out, and a slot is handed out again only after
  every GPU copy that read it has finished (its CUDA event).

Budget: the tier holds at most `budget` bytes of payloads; beyond it the least recently grafted
blocks are evicted, never blocks of the graft being made (a chain larger than the budget keeps its
first blocks, not a rotating set). The arenas also hold the slots of reads in flight (the pipeline's
ring) and keep free chunks for the next graft: `memory_bytes()` is what they hold, `clear()` frees it.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from kvmemory.errors import InvalidInput
from kvmemory.store import drops
from kvmemory.store.blocks import BlockMeta

ALIGN = 256  # slot offsets in a chunk (chunks: 64-byte aligned by torch, pinned ones page aligned): the
#             lanes reader's non-temporal stores want 64 bytes, the kernel's vector copies 16
CHUNK_BYTES = 256 << 20  # the largest arena chunk (one allocation; a pinned one pins that much at once)
FIRST_SLOTS = 16  # slots of an arena's first chunk; each further chunk doubles the arena up to CHUNK_BYTES
ENV_BUDGET = "KVMEMORY_TIER_BYTES"
SEEN_MAX = 1 << 16  # block hashes remembered as grafted once (a CPU tier admits a chain at its second graft)


def parse_bytes(text: str) -> int:
    """'0', '1073741824', '512M', '8G' (binary units) -> bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    try:
        n = int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise InvalidInput(f"{ENV_BUDGET}={text!r}: give a byte count, e.g. 0, 512M or 8G") from None
    if n < 0:
        raise InvalidInput(f"{ENV_BUDGET}={text!r}: the budget cannot be negative")
    return n


def default_budget(device: torch.device) -> int:
    """The tier's budget for an engine on `device`: $KVMEMORY_TIER_BYTES, else on a GPU 1/8 of this
    machine's memory, at most 8 GiB (pinned memory is locked; a cap, not a reservation: it is taken as
    blocks are read), and 0 on the CPU (opt-in: there a graft reads a block straight into the cache,
    so keeping it costs a second copy in RAM of what the page cache holds and one more pass over the
    bytes at the chain's second graft, for a saving on the read phase alone: what a graft on the CPU
    spends most of its time on is the step)."""
    env = os.environ.get(ENV_BUDGET)
    if env is not None and env.strip():
        return parse_bytes(env)
    if device.type != "cuda":
        return 0
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 0
    return min(8 << 30, ram // 8)


@dataclass(slots=True, eq=False)
class Slot:
    """One payload's room in an arena chunk."""

    arena: "Arena"
    chunk: torch.Tensor  # uint8 [k * stride]: the chunk this slot is a part of (graft_op's staging)
    offset: int  # byte offset of the slot in its chunk
    leases: int = 0  # grafts (reads, copies) using the slot now
    held: bool = False  # the tier keeps it (a block's verified copy)
    event: object = None  # the CUDA event recorded after the last copy that read it

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes

    def tensor(self) -> torch.Tensor:
        """The slot's bytes (uint8 [nbytes]), a view of its chunk."""
        return self.chunk[self.offset : self.offset + self.arena.nbytes]

    def address(self) -> int:
        return self.chunk.data_ptr() + self.offset


class Arena:
    """Slots of one payload size in chunks of `where` memory: "pinned" (host, page-locked: the CUDA graft
    kernel reads it directly), "cpu", or a CUDA device. Not thread-safe: the tier's lock guards it."""

    def __init__(self, nbytes: int, where: str | torch.device):
        if nbytes < 1:
            raise ValueError(f"a slot holds at least one byte, got {nbytes}")
        self.nbytes = nbytes
        self.stride = -(-nbytes // ALIGN) * ALIGN
        self.where = where
        self.chunks: list[torch.Tensor] = []
        self.free: deque[Slot] = deque()  # oldest freed first: its last copy is the likeliest finished
        self.slots = 0

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.where == "pinned":
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if self.where == "cpu":
            return torch.empty(nbytes, dtype=torch.uint8)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.where)

    def _grow(self) -> None:
        per_chunk = max(1, CHUNK_BYTES // self.stride)
        n = min(per_chunk, max(FIRST_SLOTS, self.slots))
        chunk = self._allocate(n * self.stride)
        self.chunks.append(chunk)
        self.free.extend(Slot(self, chunk, i * self.stride) for i in range(n))
        self.slots += n

    def acquire(self) -> Slot:
        """A free slot, leased once; waits for the last GPU copy that read it."""
        if not self.free:
            self._grow()
        slot = self.free.popleft()
        if slot.event is not None:
            slot.event.synchronize()
            slot.event = None
        slot.leases = 1
        return slot

    def release(self, slot: Slot) -> None:
        self.free.append(slot)

    def memory_bytes(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def trim(self) -> None:
        """Free the chunks none of whose slots is in use."""
        free_of: dict[int, int] = {}
        for s in self.free:
            free_of[id(s.chunk)] = free_of.get(id(s.chunk), 0) + 1
        idle = {id(c) for c in self.chunks if free_of.get(id(c), 0) * self.stride == c.numel()}
        if not idle:
            return
        for s in self.free:
            if id(s.chunk) in idle and s.event is not None:
                s.event.synchronize()  # a copy still reading it: wait before the memory goes back
        self.free = deque(s for s in self.free if id(s.chunk) not in idle)
        kept = [c for c in self.chunks if id(c) not in idle]
        self.slots -= sum(c.numel() for c in self.chunks if id(c) in idle) // self.stride
        self.chunks = kept


@dataclass(slots=True, eq=False)
class Held:
    """A block's verified payload in the tier: its header (checked against the catalogue when read)
    and its slot."""

    meta: BlockMeta
    slot: Slot
    graft: int  # the last graft that used it (never evicted by that graft's own admissions)


@dataclass(slots=True)
class TierStats:
    hits: int = 0
    misses: int = 0
    admitted: int = 0
    refused: int = 0  # admissions refused: the budget is held by the graft's own blocks (or is 0)
    evicted: int = 0
    dropped: int = 0  # by the store (quarantine, delete, evict) or `drop`
    stale: int = 0  # held under a row that no longer matches (the block was rewritten)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def _same_block(meta: BlockMeta, row) -> bool:
    """Whether the catalogue row is the one the held header was checked against (every field it repeats)."""
    return (meta.hash == row.hash and meta.payload_sha256 == row.payload_sha256
            and meta.payload_nbytes == row.payload_nbytes and meta.parent == row.parent
            and meta.profile_id == row.profile_id and meta.index == row.index and meta.n_tokens == row.n_tokens)


class VerifiedTier:
    """Verified block payloads kept in `where` memory ("pinned", "cpu" or a CUDA device), at most `budget`
    bytes, least recently grafted evicted first. Thread-safe (a store may drop blocks from a reader
    thread). `budget=0` keeps nothing: the arenas then serve only as a graft's staging."""

    def __init__(self, budget: int, where: str | torch.device = "cpu"):
        if budget < 0:
            raise InvalidInput(f"the tier's budget cannot be negative, got {budget}")
        if where == "pinned" and not torch.cuda.is_available():
            where = "cpu"  # page-locking needs CUDA; the bytes are the same (tests on CPU machines)
        self.budget = int(budget)
        self.where = where
        self.stats = TierStats()
        self._lock = threading.RLock()
        self._arenas: dict[int, Arena] = {}
        self._held: OrderedDict[str, Held] = OrderedDict()  # block hash -> held payload, LRU first
        self._bytes = 0
        self._graft = 0
        # On a GPU a graft reads into the tier's slots anyway, so keeping them costs nothing; on the CPU
        # a block is read straight into the cache and keeping it costs one more copy, paid only for
        # chains grafted a second time (`wants`).
        self.first_sight = where != "cpu"
        self._seen: OrderedDict[str, None] = OrderedDict()
        drops.listen(self._on_dropped)

    @classmethod
    def for_device(cls, device: torch.device, budget: int | None = None) -> "VerifiedTier":
        """The tier for an engine on `device`: pinned host memory for a GPU, RAM for the CPU."""
        return cls(default_budget(device) if budget is None else budget,
                   "pinned" if device.type == "cuda" else "cpu")

    # ------------------------------------------------------------------ one graft
    def wants(self, rows) -> bool:
        """Whether a graft of the chain `rows` should go through the tier: on a GPU always (with a
        budget); on the CPU when the tier holds one of its blocks or the chain was grafted before (its
        first block seen), so a chain grafted once costs nothing more than without a tier."""
        if self.budget <= 0 or not rows:
            return False
        if self.first_sight:
            return True
        with self._lock:
            if rows[0].hash in self._seen or any(r.hash in self._held for r in rows):
                return True
            for r in rows:
                self._seen[r.hash] = None
                self._seen.move_to_end(r.hash)
            while len(self._seen) > SEEN_MAX:
                self._seen.popitem(last=False)
            return False

    def begin(self) -> None:
        """A graft starts: blocks it uses from now on are not evicted by its own admissions."""
        with self._lock:
            self._graft += 1

    def lookup(self, row) -> Held | None:
        """The verified copy of the block of catalogue `row`, leased (give it back with `release`), or None."""
        with self._lock:
            held = self._held.get(row.hash)
            if held is None:
                self.stats.misses += 1
                return None
            if not _same_block(held.meta, row):  # another payload under this hash now: never serve it
                self._discard(row.hash)
                self.stats.stale += 1
                self.stats.misses += 1
                return None
            self._held.move_to_end(row.hash)
            held.graft = self._graft
            held.slot.leases += 1
            self.stats.hits += 1
            return held

    def acquire(self, nbytes: int) -> Slot:
        """A leased slot of `nbytes` bytes to read a payload into."""
        with self._lock:
            arena = self._arenas.get(nbytes)
            if arena is None:
                arena = self._arenas[nbytes] = Arena(nbytes, self.where)
            return arena.acquire()

    def admit(self, meta: BlockMeta, slot: Slot) -> bool:
        """Keep `slot`, which holds block `meta`'s payload, verified against `meta.payload_sha256` (the
        caller's promise: only a verified read calls this), as that block's copy. False when the budget
        has no room left that this graft's own blocks do not hold."""
        with self._lock:
            if slot.held or slot.nbytes != meta.payload_nbytes:
                return False
            if meta.hash in self._held:  # read again while held (e.g. rewritten): the new read wins
                self._discard(meta.hash)
            need = self._bytes + slot.nbytes - self.budget
            if need > 0:
                victims, freed = [], 0
                for h, held in self._held.items():  # least recently grafted first
                    if freed >= need:
                        break
                    if held.graft != self._graft:
                        victims.append(h)
                        freed += held.slot.nbytes
                if freed < need:
                    self.stats.refused += 1
                    return False
                for h in victims:
                    self._discard(h)
                    self.stats.evicted += 1
            slot.held = True
            self._held[meta.hash] = Held(meta, slot, self._graft)
            self._bytes += slot.nbytes
            self.stats.admitted += 1
            return True

    def release(self, slot: Slot, event=None) -> None:
        """End one lease of `slot`; `event`: the CUDA event recorded after the last copy that read it."""
        with self._lock:
            if event is not None:
                slot.event = event
            slot.leases -= 1
            if slot.leases <= 0 and not slot.held:
                slot.leases = 0
                slot.arena.release(slot)

    # ------------------------------------------------------------------ invalidation and memory
    def drop(self, hashes) -> int:
        """Forget these blocks' copies; returns how many were held."""
        with self._lock:
            n = 0
            for h in hashes:
                if h in self._held:
                    self._discard(h)
                    n += 1
            self.stats.dropped += n
            return n

    def _on_dropped(self, hashes: list[str], why: str) -> None:
        self.drop(hashes)

    def _discard(self, h: str) -> None:
        held = self._held.pop(h)
        self._bytes -= held.slot.nbytes
        held.slot.held = False
        if held.slot.leases <= 0:
            held.slot.arena.release(held.slot)

    def set_budget(self, budget: int) -> None:
        """Change the budget; evicts (least recently grafted first) down to it."""
        if budget < 0:
            raise InvalidInput(f"the tier's budget cannot be negative, got {budget}")
        with self._lock:
            self.budget = int(budget)
            while self._bytes > self.budget and self._held:
                self._discard(next(iter(self._held)))
                self.stats.evicted += 1
            self.trim()

    def clear(self) -> None:
        """Forget every copy and free the memory no graft is using."""
        with self._lock:
            for h in list(self._held):
                self._discard(h)
            self.trim()

    def trim(self) -> None:
        """Free the arena chunks that hold nothing (kept otherwise for the next graft's reads)."""
        with self._lock:
            for size, arena in list(self._arenas.items()):
                arena.trim()
                if not arena.chunks:
                    del self._arenas[size]

    def held_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def memory_bytes(self) -> int:
        """Bytes the arenas hold: the copies, the slots in use and the free slots kept."""
        with self._lock:
            return sum(a.memory_bytes() for a in self._arenas.values())

    def __contains__(self, block_hash: str) -> bool:
        with self._lock:
            return block_hash in self._held

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def to_json(self) -> dict:
        with self._lock:
            return {"where": str(self.where), "budget_bytes": self.budget, "held_blocks": len(self._held),
                    "held_bytes": self._bytes, "memory_bytes": self.memory_bytes(), **self.stats.to_json()}


__all__ = ["Arena", "Held", "Slot", "TierStats", "VerifiedTier", "default_budget", "parse_bytes"]
