"""The `Store` protocol: what the engine and the facade ask of a store, whatever keeps its bytes.

`LocalStore` (a folder: block files + a SQLite catalogue), `SignedLocalStore` (the same, with signed
rows for shared folders) and `RedisStore` (a Redis server or cluster) all satisfy it; `open_store`
picks one from a string. The unit of storage is a block (store/blocks.py: the K/V of every layer for
`C` positions, content-addressed by its chain hash) and an entry (`EntryRecord`: a verified solution,
its token ids and the chain of its blocks). A store verifies every payload (SHA-256 against its
catalogue) before a byte of it is handed out, and quarantines what fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from kvmemory.store.blocks import BlockMeta
from kvmemory.store.local import BlockRow, EntryRecord, StoreStats

Block = tuple[BlockMeta, torch.Tensor]  # a block's header and its payload (uint8, blocks.py's layout)


@runtime_checkable
class Store(Protocol):
    """A block and entry store (see the module docstring). Methods raise kvmemory's typed errors:
    `IntegrityError` for bytes that do not check, `UnknownEntry`, `StoreReadOnly`, `StoreError`."""

    kind: str  # "local", "signed-local", "redis"
    path: Path  # a local folder (for Redis: its read-through tier); the router lives in <path>/router
    readonly: bool

    # profiles: the execution profiles blocks were made under (engine/profile.py)
    def put_profile(self, profile_id: str, profile: dict) -> None: ...
    def get_profile(self, profile_id: str) -> dict | None: ...

    # blocks
    def get_block(self, h: str) -> BlockRow | None: ...
    def known_blocks(self, hashes: Sequence[str]) -> dict[str, BlockRow]: ...
    def write_block_files(self, blocks: Sequence[Block]) -> dict[str, int]: ...
    def put_blocks(self, blocks: Sequence[Block], *, verified: bool = False, pinned: bool = False) -> int: ...
    def read_block(self, row: BlockRow, into=None) -> tuple[BlockMeta, object]: ...
    def touch_blocks(self, hashes: Sequence[str]) -> None: ...
    def quarantine(self, h: str, reason: str) -> None: ...

    # entries
    def commit_entry(self, entry: EntryRecord, blocks: Sequence[Block]) -> None: ...
    def get_entry(self, entry_id: str, namespace: str | None = None) -> EntryRecord: ...
    def list_entries(self, namespace: str | None = None) -> list[EntryRecord]: ...
    def entry_ids(self, namespace: str | None = None) -> list[str]: ...
    def update_attestation(self, entry_id: str, attestation: dict, verified: bool) -> None: ...
    def delete_entries(self, entry_ids: Sequence[str]) -> int: ...

    # The change feed (store/feed.py), what routers follow instead of listing the store per question; every
    # store here has it (a store without it is resynced by listing, as before):
    #   feed_head() -> FeedHead | None               the feed's id and last sequence number (one cheap read)
    #   changes_since(seq, limit) -> list[Change] | None   newer records, None when some were trimmed
    # Optional: has_record(entry_id) -> bool: the entry has a record beside its blocks (store/records.py),
    # so one the catalogue lacks was lost by damage, not forgotten (recall names it, fsck puts it back).
    # Optional fast paths the graft uses when a store has them (LocalStore does):
    #   block_meta(row) -> BlockMeta                 a block's checked header without its payload
    #   read_blocks_lanes(rows, place) -> list       up to 16 blocks read and hashed straight into place

    # housekeeping
    def stats(self) -> StoreStats: ...
    def evict(self, max_bytes: int) -> int: ...
    def close(self) -> None: ...
