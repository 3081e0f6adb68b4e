"""KV blocks: the chain hash, the payload layout, and the on-disk block file format.

A block holds the K and V of every layer for one prefill chunk of the canonical runner: `T <= C`
consecutive positions starting at `position`, the chain's `index`-th chunk. Chunks end on the grid
(multiples of C) and at cuts (runner.chunk_spans: the end of a stored entry or a chat turn), so a block
is a whole grid block (`position = index * C`, T = C) unless a cut ends it or started it (a tail block).
Blocks are content-addressed by a chain hash

    h_i = SHA-256(profile_id ‖ h_{i-1} ‖ token_ids of block i)      (h_{-1} = 32 zero bytes)

so a block is found only after exactly the same preceding tokens, under the same profile, at its own
position; shared prefixes (system prompt, few-shot examples) hash the same and are stored once. The
token ids' byte length fixes T, and with the parents every earlier block's, so a chain hash names one
sequence of chunk lengths: chunks cut elsewhere (computed with other shapes) hash differently.

Payload layout (raw bytes in the cache dtype, no conversion): for layer l = 0..L-1, K_l then V_l, each
a C-contiguous array `[H_l, T, D_l]` (KV heads, tokens, head dim) — the layer's cache slice
`cache.layers[l].keys[0, :, position:position+T, :]`. This is what `graft_op.graft_copy` reads.

File format (`.kvb`): `b"KVMB"`, u16 format version, u16 reserved, u32 header length (little endian),
the header as UTF-8 JSON, zero padding to a multiple of 64 bytes, then the payload. The header repeats
what the catalogue holds (hash, parent, profile, tokens, shapes, payload SHA-256) so a file can be
checked on its own; the catalogue stays the authority.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvmemory.errors import IntegrityError

MAGIC = b"KVMB"
BLOCK_FORMAT = 1
_PREFIX = struct.Struct("<4sHHI")
ALIGN = 64
_ZERO = bytes(32)
MAX_HEADER = 1 << 20

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": getattr(torch, "float8_e4m3fn", None),
    "float8_e5m2": getattr(torch, "float8_e5m2", None),
}


def ids_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 (the form hashed and stored)."""
    return np.asarray(token_ids, dtype="<u4").tobytes()


def _chain_digest(profile: bytes, parent: bytes, ids: bytes) -> bytes:
    """h_i's 32 bytes from the profile id's, h_{i-1}'s (zeros for the first block) and the ids' bytes."""
    return hashlib.sha256(profile + parent + ids).digest()


def chain_hash(profile_id: str, parent: str | None, token_ids: Sequence[int]) -> str:
    return _chain_digest(bytes.fromhex(profile_id), bytes.fromhex(parent) if parent else _ZERO,
                         ids_bytes(token_ids)).hex()


def chain_hashes(profile_id: str, token_ids: Sequence[int], chunk: int, limit: int | None = None,
                 tail: bool = False) -> list[str]:
    """Hashes of the full blocks of `token_ids` (up to `limit` tokens), in order. `tail`: and of the
    last, partial block too (the ids' last chunk up to their end, where a cut ends it: an entry's chain,
    runner.chunk_spans)."""
    n = len(token_ids) if limit is None else min(limit, len(token_ids))
    if tail and n % chunk:
        full = n - n % chunk
        return span_hashes(profile_id, token_ids, [(s, s + chunk) for s in range(0, full, chunk)] + [(full, n)])
    n = max(0, n - n % chunk)
    ids = ids_bytes(token_ids[:n])  # converted once (8k ids: one call, not 128), sliced per block
    profile = bytes.fromhex(profile_id)
    out: list[str] = []
    parent = _ZERO
    for s in range(0, 4 * n, 4 * chunk):
        parent = _chain_digest(profile, parent, ids[s : s + 4 * chunk])
        out.append(parent.hex())
    return out


def is_entry_chain(chain: Sequence[str], profile_id: str, token_ids: Sequence[int], chunk: int) -> bool:
    """Whether `chain` is the chain of an entry with these token ids: every chunk of them, the last one a
    tail block cut at their end (how `remember` stores entries since cuts, runner.chunk_spans), or, for
    entries made before, their whole grid blocks (all of them, or those before the last token)."""
    chain, ids = list(chain), list(token_ids)
    if chain == chain_hashes(profile_id, ids, chunk, tail=True):
        return True
    return chain in (chain_hashes(profile_id, ids, chunk), chain_hashes(profile_id, ids, chunk, limit=len(ids) - 1))


def span_hashes(profile_id: str, token_ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> list[str]:
    """Chain hashes of consecutive chunks [(0, e0), (e0, e1), ...] of `token_ids`, of any lengths (a grid
    block, a tail block at a cut), in order. Equal to `chain_hashes` where every span is a whole block."""
    profile = bytes.fromhex(profile_id)
    end = spans[-1][1] if spans else 0
    ids = ids_bytes(token_ids[:end])  # converted once, sliced per span
    out: list[str] = []
    parent, pos = _ZERO, 0
    for s, e in spans:
        if s != pos or e <= s or e > len(token_ids):
            raise ValueError(f"spans must be consecutive chunks of the ids from position 0, got {(s, e)} at {pos}")
        parent = _chain_digest(profile, parent, ids[4 * s : 4 * e])
        out.append(parent.hex())
        pos = e
    return out


def _shapes(v) -> tuple[tuple[int, int, int], ...]:
    """Per-layer [H, T, D] shapes: three non-negative integers each (anything else is a damaged header)."""
    out = tuple(tuple(int(x) for x in s) for s in v)
    if not all(len(s) == 3 and min(s) >= 0 for s in out):
        raise ValueError("a layer shape is not three non-negative integers")
    return out


@dataclass(slots=True, frozen=True)
class BlockMeta:
    """Everything about a block but its payload bytes."""

    hash: str
    parent: str | None
    profile_id: str
    index: int
    position: int
    token_ids: tuple[int, ...]
    dtype: str
    k_shapes: tuple[tuple[int, int, int], ...]  # per layer [H_l, T, D_l]
    v_shapes: tuple[tuple[int, int, int], ...]
    payload_nbytes: int
    payload_sha256: str

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    def to_json(self) -> dict:
        # Spelled out rather than dataclasses.asdict (a recursive deep copy): every graft re-encodes
        # each block's header to check it is canonical, so this runs once per block read.
        return {"hash": self.hash, "parent": self.parent, "profile_id": self.profile_id, "index": self.index,
                "position": self.position, "token_ids": list(self.token_ids), "dtype": self.dtype,
                "k_shapes": [list(x) for x in self.k_shapes], "v_shapes": [list(x) for x in self.v_shapes],
                "payload_nbytes": self.payload_nbytes, "payload_sha256": self.payload_sha256,
                "format": BLOCK_FORMAT}

    @classmethod
    def from_json(cls, d: dict) -> "BlockMeta":
        try:
            return cls(
                hash=str(d["hash"]),
                parent=d["parent"],
                profile_id=str(d["profile_id"]),
                index=int(d["index"]),
                position=int(d["position"]),
                token_ids=tuple(int(t) for t in d["token_ids"]),
                dtype=str(d["dtype"]),
                k_shapes=_shapes(d["k_shapes"]),
                v_shapes=_shapes(d["v_shapes"]),
                payload_nbytes=int(d["payload_nbytes"]),
                payload_sha256=str(d["payload_sha256"]),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int(Infinity)
            raise IntegrityError(f"malformed block header: {exc}") from exc

    def expected_nbytes(self) -> int:
        dt = DTYPES.get(self.dtype)
        if dt is None:
            raise IntegrityError(f"block dtype {self.dtype!r} is unknown")
        esize = dt.itemsize
        return esize * sum(h * t * d for shapes in (self.k_shapes, self.v_shapes) for h, t, d in shapes)


def encode_header(meta: BlockMeta) -> bytes:
    body = json.dumps(meta.to_json(), sort_keys=True, separators=(",", ":")).encode()
    head = _PREFIX.pack(MAGIC, BLOCK_FORMAT, 0, len(body)) + body
    return head + bytes(-len(head) % ALIGN)


def parse_header(buf: bytes) -> tuple[BlockMeta, int]:
    """Parse and check a block file's header; returns the meta and the payload's byte offset."""
    if len(buf) < _PREFIX.size:
        raise IntegrityError("block file truncated before its header")
    magic, fmt, _, hlen = _PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise IntegrityError("not a kvmemory block file (bad magic)")
    if fmt > BLOCK_FORMAT:
        raise IntegrityError(f"block format {fmt} is newer than this kvmemory reads ({BLOCK_FORMAT})")
    if hlen > MAX_HEADER or _PREFIX.size + hlen > len(buf):
        raise IntegrityError("block file truncated inside its header")
    try:
        d = json.loads(buf[_PREFIX.size : _PREFIX.size + hlen])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IntegrityError(f"block header is not valid JSON: {exc}") from exc
    if not isinstance(d, dict):
        raise IntegrityError("block header is not a JSON object")
    meta = BlockMeta.from_json(d)
    if meta.expected_nbytes() != meta.payload_nbytes:
        raise IntegrityError("block header shapes do not add up to its payload size")
    if any(t != meta.n_tokens for shapes in (meta.k_shapes, meta.v_shapes) for _, t, _ in shapes):
        raise IntegrityError("block header shapes do not hold its token count")
    off = _PREFIX.size + hlen
    return meta, off + (-off % ALIGN)


def read_header(fh) -> tuple[BlockMeta, int]:
    """Read and parse the header of an open block file; returns the meta and the payload offset."""
    prefix = fh.read(_PREFIX.size)
    if len(prefix) < _PREFIX.size:
        raise IntegrityError("block file truncated before its header")
    hlen = _PREFIX.unpack(prefix)[3]
    if hlen > MAX_HEADER:
        raise IntegrityError("block header length is implausible")
    return parse_header(prefix + fh.read(hlen))


def capture_payload(cache, start: int, end: int) -> tuple[torch.Tensor, str, list, list]:
    """Copy positions [start, end) of every layer of `cache` (just computed) into one payload.

    Returns (payload uint8 [N] on CPU, dtype name, k_shapes, v_shapes). The chunk's K/V are the last
    `end - start` rows of each layer (sliding layers keep >= C rows, checked by the runner).
    """
    t = end - start
    parts: list[torch.Tensor] = []
    k_shapes, v_shapes = [], []
    dtype = None
    for layer in cache.layers:
        k = layer.keys[0, :, -t:, :]
        v = layer.values[0, :, -t:, :]
        dtype = k.dtype
        k_shapes.append(tuple(k.shape))
        v_shapes.append(tuple(v.shape))
        parts.extend((k, v))
    total = sum(p.numel() * p.element_size() for p in parts)
    payload = torch.empty(total, dtype=torch.uint8)
    off = 0
    for p in parts:
        nb = p.numel() * p.element_size()
        # Byte copy through an integer view: no value conversion, NaN payloads survive.
        payload[off : off + nb].view(p.dtype).view(p.shape).copy_(p.cpu() if p.device.type != "cpu" else p)
        off += nb
    return payload, str(dtype).removeprefix("torch."), k_shapes, v_shapes
