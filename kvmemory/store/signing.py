"""Signed entries and blocks for shared stores: HMAC-SHA256 over canonical manifests, per-namespace keys.

Why: a shared store (Redis, or a folder several machines write) is only as trustworthy as everyone
who can write to it. An entry carries text that reaches the model and a chain of KV blocks that are
grafted into its cache; the SHA-256 checks of the store catch damage, not an adversary who rewrites
both a payload and its catalogue hash. In shared mode every entry and every block row is signed, and
unsigned or forged ones are refused before anything reaches the model.

Keys. One master key (`KVMEMORY_SIGNING_KEY`, hex of >= 32 digits or text of >= 16 characters, or the
`key=` argument). Each namespace signs with its own key derived from it,

    K_ns = HMAC-SHA256(master, b"kvmemory-namespace\\x00" + namespace)

so a tenant can be handed only its `K_ns` (`Signer(key, namespace=ns)`, or `KVMEMORY_SIGNING_KEY` set to
that key plus `KVMEMORY_SIGNING_NAMESPACE=ns`): it can sign and verify in its own namespace and nowhere
else. A signature is `"v1:" + hex(HMAC-SHA256(K_ns, canonical JSON of the manifest))`, compared with
`hmac.compare_digest`.

Manifests (canonical JSON: sorted keys, no spaces, ASCII):
- entry: {"kind": "entry", "v": 1, "id", "namespace", "problem_sha256", "solution_sha256", "answer_sha256"
  (null when no answer), "verifier_sha256", "verified", "token_ids_sha256" (over <u4 bytes), "n_tokens",
  "profile_id", "chain": [[block hash, payload sha256], ...], "attestation_id", "attestation_sha256",
  "meta_sha256", "created", "updated"} -- every field of the entry record, so any change is caught;
- block: {"kind": "block", "v": 1, "namespace", "hash", "parent", "profile_id", "index", "n_tokens",
  "payload_sha256", "payload_nbytes"} -- what decides which bytes are grafted and where. The flags
  (verified, pinned, quarantined, last use) are bookkeeping: they never put a byte in front of the model.

A block row holds one signature per namespace that stored it: a reader scoped to a namespace sees a
block only when its own namespace signed it (content addressing still stores the bytes once).

`SignedLocalStore` is the local store in shared mode: signatures live in a `signatures` table of the
same catalogue and are written in the same SQLite transaction as the rows they sign.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import re
import sqlite3
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import contextmanager

from kvmemory.store.blocks import BlockMeta, ids_bytes
from kvmemory.errors import IntegrityError, InvalidInput, KVMemoryError, StoreError, UnknownEntry
from kvmemory.store.local import BlockRow, EntryRecord, LocalStore

ENV_KEY = "KVMEMORY_SIGNING_KEY"
ENV_NAMESPACE = "KVMEMORY_SIGNING_NAMESPACE"
SIG_PREFIX = "v1:"
MIN_KEY_BYTES = 16
_NS_LABEL = b"kvmemory-namespace\x00"
_HEX = re.compile(r"[0-9a-fA-F]+")


class SignatureError(IntegrityError):
    """An entry or block that is unsigned, or whose signature does not match (forged or altered)."""


class SigningKeyError(KVMemoryError):
    """No usable signing key where one is required (say where to set it), or a key that is too short."""


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True).encode()


def _sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def parse_key(value: str | bytes) -> bytes:
    """A key from configuration: bytes as given; text of hex digits (even length >= 32) as hex, other
    text as its UTF-8 bytes. Keys under 16 bytes are refused (a short HMAC key is guessable)."""
    if isinstance(value, bytes):
        key = value
    elif isinstance(value, str):
        v = value.strip()
        key = bytes.fromhex(v) if len(v) >= 32 and len(v) % 2 == 0 and _HEX.fullmatch(v) else v.encode()
    else:
        raise SigningKeyError(f"a signing key is text or bytes, got {type(value).__name__}")
    if len(key) < MIN_KEY_BYTES:
        raise SigningKeyError(f"the signing key has {len(key)} bytes; use at least {MIN_KEY_BYTES} "
                              "(e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    return key


def _check_ns(namespace: object) -> str:
    if not isinstance(namespace, str) or not namespace or len(namespace) > 256 or "\x00" in namespace:
        raise InvalidInput(f"a namespace is non-empty text without NUL (<= 256 characters), got {namespace!r}")
    return namespace


def entry_manifest(entry: EntryRecord, chain_sha256: Sequence[str]) -> dict:
    """The canonical manifest of an entry (see the module docstring); `chain_sha256[i]` is the payload
    SHA-256 of `entry.chain[i]`."""
    if len(chain_sha256) != len(entry.chain):
        raise SignatureError(f"entry {entry.id}: {len(entry.chain)} chain blocks but {len(chain_sha256)} payload hashes")
    att = entry.attestation if isinstance(entry.attestation, dict) else {}
    return {
        "kind": "entry",
        "v": 1,
        "id": entry.id,
        "namespace": entry.namespace,
        "problem_sha256": _sha(entry.problem),
        "solution_sha256": _sha(entry.solution),
        "answer_sha256": None if entry.answer is None else _sha(entry.answer),
        "verifier_sha256": _sha(_canonical(entry.verifier)),
        "verified": bool(entry.verified),
        "token_ids_sha256": _sha(ids_bytes(entry.token_ids)),
        "n_tokens": len(entry.token_ids),
        "profile_id": entry.profile_id,
        "chain": [[h, s] for h, s in zip(entry.chain, chain_sha256)],
        "attestation_id": att.get("attestation_id"),
        "attestation_sha256": _sha(_canonical(entry.attestation)),
        "meta_sha256": _sha(_canonical(entry.meta)),
        "created": float(entry.created),
        "updated": float(entry.updated),
    }


def block_manifest(block: BlockRow | BlockMeta, namespace: str) -> dict:
    """The canonical manifest of a block as stored for `namespace` (a BlockRow or the BlockMeta it came from)."""
    return {
        "kind": "block",
        "v": 1,
        "namespace": namespace,
        "hash": block.hash,
        "parent": block.parent,
        "profile_id": block.profile_id,
        "index": int(block.index),
        "n_tokens": int(block.n_tokens),
        "payload_sha256": block.payload_sha256,
        "payload_nbytes": int(block.payload_nbytes),
    }


class Signer:
    """Signs and verifies manifests with per-namespace keys derived from a master key.

    `Signer(master)` can sign for every namespace; `Signer(ns_key, namespace=ns)` (a key handed to one
    tenant, see `namespace_key`) only for `ns`. `namespace` is then also the signer's `scope`.
    """

    def __init__(self, key: str | bytes, *, namespace: str | None = None):
        raw = parse_key(key)
        self.scope = None if namespace is None else _check_ns(namespace)
        self._master = raw if namespace is None else None
        self._ns_keys: dict[str, bytes] = {} if namespace is None else {namespace: raw}
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Signer | None":
        env = os.environ if environ is None else environ
        key = env.get(ENV_KEY)
        if not key:
            return None
        return cls(key, namespace=env.get(ENV_NAMESPACE) or None)

    @classmethod
    def resolve(cls, signer: "Signer | str | bytes | None") -> "Signer | None":
        """A Signer from an instance, a key, or (None) the environment."""
        if signer is None:
            return cls.from_env()
        if isinstance(signer, Signer):
            return signer
        return cls(signer)

    def __repr__(self) -> str:  # never print key material
        return f"Signer(scope={self.scope!r})"

    # ------------------------------------------------------------------ keys
    def can_sign(self, namespace: str) -> bool:
        return self._master is not None or namespace in self._ns_keys

    def namespace_key(self, namespace: str) -> bytes:
        """The key of one namespace (hand it to that tenant only)."""
        namespace = _check_ns(namespace)
        with self._lock:
            k = self._ns_keys.get(namespace)
            if k is None:
                if self._master is None:
                    raise SignatureError(f"this signer holds only the key of namespace {self.scope!r}, "
                                         f"not of {namespace!r}")
                k = hmac.new(self._master, _NS_LABEL + namespace.encode(), hashlib.sha256).digest()
                self._ns_keys[namespace] = k
            return k

    # ------------------------------------------------------------------ sign / verify
    def sign(self, manifest: dict) -> str:
        ns = manifest.get("namespace")
        return SIG_PREFIX + hmac.new(self.namespace_key(ns), _canonical(manifest), hashlib.sha256).hexdigest()

    def valid(self, manifest: dict, signature: object) -> bool:
        """True when `signature` is this manifest's; False for a missing, malformed or forged one, and for
        a namespace whose key this signer does not hold."""
        if not isinstance(signature, str) or not signature.startswith(SIG_PREFIX):
            return False
        if not self.can_sign(manifest.get("namespace", "")):
            return False
        try:
            expected = self.sign(manifest)
        except KVMemoryError:
            return False
        return hmac.compare_digest(expected.encode(), signature.encode())

    def verify(self, manifest: dict, signature: object, what: str) -> None:
        if signature is None or signature == "":
            raise SignatureError(f"{what} is unsigned; a shared store serves only signed entries "
                                 "(re-remember it with the store's signing key)")
        if not self.valid(manifest, signature):
            raise SignatureError(f"{what} has a signature that does not match its contents (forged or altered); "
                                 "it is refused. `kvmemory fsck --repair` quarantines it")

    def sign_entry(self, entry: EntryRecord, chain_sha256: Sequence[str]) -> str:
        return self.sign(entry_manifest(entry, chain_sha256))

    def verify_entry(self, entry: EntryRecord, chain_sha256: Sequence[str], signature: object) -> None:
        try:
            manifest = entry_manifest(entry, chain_sha256)
        except SignatureError:
            raise SignatureError(f"entry {entry.id!r}: its signed chain does not match its blocks") from None
        self.verify(manifest, signature, f"entry {entry.id!r}")

    def sign_block(self, block: BlockRow | BlockMeta, namespace: str) -> str:
        return self.sign(block_manifest(block, namespace))

    def block_valid(self, block: BlockRow | BlockMeta, namespace: str, signature: object) -> bool:
        return self.valid(block_manifest(block, namespace), signature)


# ---------------------------------------------------------------------- the local store in shared mode
_SIG_SCHEMA = """
CREATE TABLE IF NOT EXISTS signatures(
    kind TEXT NOT NULL,          -- 'entry' or 'block'
    key TEXT NOT NULL,           -- entry id or block hash
    namespace TEXT NOT NULL,
    sig TEXT NOT NULL,
    chain_sha256 TEXT NOT NULL DEFAULT '',   -- entries: the chain's payload SHA-256s, comma separated
    PRIMARY KEY(kind, key, namespace)
);
"""


class SignedLocalStore(LocalStore):
    """A LocalStore that signs what it writes and refuses what is unsigned or forged.

    `namespace` (or a signer holding one namespace's key) scopes the store to one tenant: entries of
    other namespaces are unknown to it, and blocks count as stored only when that namespace signed them.
    Unscoped, a block is visible when any namespace this signer can verify signed it.
    """

    kind = "local-signed"

    def __init__(self, path, *, signer: Signer | str | bytes | None = None, namespace: str | None = None,
                 readonly: bool = False, create: bool = True):
        resolved = Signer.resolve(signer)
        if resolved is None:
            raise SigningKeyError(f"a signed store needs a key: set {ENV_KEY} or pass signer=/signing_key=")
        self.signer = resolved
        if namespace is not None and resolved.scope is not None and namespace != resolved.scope:
            raise SigningKeyError(f"the key given holds namespace {resolved.scope!r}, not {namespace!r}")
        self.namespace = _check_ns(namespace) if namespace is not None else resolved.scope
        self.rejected: list[str] = []  # ids of entries list_entries refused (unsigned / forged)
        self._pending = threading.local()
        super().__init__(path, readonly=readonly, create=create)
        if not self.readonly:
            try:
                self._db().executescript(_SIG_SCHEMA)
            except sqlite3.Error as exc:
                raise self._wrap(exc) from exc

    # Signatures are inserted inside the very transaction LocalStore opens for the rows they sign, so a
    # reader sees rows and signatures together or neither.
    @contextmanager
    def _tx(self):
        with super()._tx() as db:
            yield db
            rows = getattr(self._pending, "rows", None)
            if rows:
                self._pending.rows = None
                db.executemany("INSERT OR REPLACE INTO signatures(kind, key, namespace, sig, chain_sha256) "
                               "VALUES(?,?,?,?,?)", rows)

    @contextmanager
    def _signing(self, rows: list[tuple]):
        self._pending.rows = rows
        try:
            yield
        finally:
            self._pending.rows = None

    def _sigs(self, kind: str, key: str) -> list[tuple[str, str, str]]:
        try:
            return self._q("SELECT namespace, sig, chain_sha256 FROM signatures WHERE kind=? AND key=?", (kind, key))
        except StoreError:
            if self.readonly:  # a read-only copy of a store that never had a signatures table: all unsigned
                return []
            raise

    def _write_ns(self) -> str:
        return self.namespace or "default"

    # ------------------------------------------------------------------ blocks
    def block_visible(self, row: BlockRow) -> bool:
        """Unsigned or forged rows (or another tenant's) are not there for this reader."""
        for ns, sig, _ in self._sigs("block", row.hash):
            if self.namespace is not None and ns != self.namespace:
                continue
            if self.signer.block_valid(row, ns, sig):
                return True
        return False

    def put_blocks(self, blocks, *, verified: bool = False, pinned: bool = False) -> int:
        ns = self._write_ns()
        rows = [("block", m.hash, ns, self.signer.sign_block(m, ns), "") for m, _ in blocks]
        with self._signing(rows):
            return super().put_blocks(blocks, verified=verified, pinned=pinned)

    # ------------------------------------------------------------------ entries
    def _chain_sha(self, entry: EntryRecord, blocks) -> list[str]:
        metas = {m.hash: m.payload_sha256 for m, _ in blocks}
        out = []
        for h in entry.chain:
            sha = metas.get(h)
            if sha is None:
                row = self._raw_blocks([h]).get(h)
                if row is None:
                    raise StoreError(f"entry {entry.id}: chain block {h[:12]} is neither given nor stored")
                sha = row.payload_sha256
            out.append(sha)
        return out

    def commit_entry(self, entry: EntryRecord, blocks) -> None:
        if self.namespace is not None and entry.namespace != self.namespace:
            raise InvalidInput(f"this store is scoped to namespace {self.namespace!r}; "
                               f"entry {entry.id} belongs to {entry.namespace!r}")
        chain_sha = self._chain_sha(entry, blocks)
        ns = entry.namespace
        rows = [("block", m.hash, ns, self.signer.sign_block(m, ns), "") for m, _ in blocks]
        rows.append(("entry", entry.id, ns, self.signer.sign_entry(entry, chain_sha), ",".join(chain_sha)))
        with self._signing(rows):
            super().commit_entry(entry, blocks)

    def commit_entries(self, items) -> None:
        """`LocalStore.commit_entries` with every row signed, the signatures in the same transaction."""
        rows = []
        for entry, blocks in items:
            if self.namespace is not None and entry.namespace != self.namespace:
                raise InvalidInput(f"this store is scoped to namespace {self.namespace!r}; "
                                   f"entry {entry.id} belongs to {entry.namespace!r}")
            chain_sha = self._chain_sha(entry, blocks)
            ns = entry.namespace
            rows += [("block", m.hash, ns, self.signer.sign_block(m, ns), "") for m, _ in blocks]
            rows.append(("entry", entry.id, ns, self.signer.sign_entry(entry, chain_sha), ",".join(chain_sha)))
        with self._signing(rows):
            super().commit_entries(items)

    def _record_signature(self, entry: EntryRecord) -> dict | None:
        """The entry's signature as its record keeps it (so a rebuilt catalogue is signed as before)."""
        for kind, key, ns, sig, cs in getattr(self._pending, "rows", None) or ():
            if kind == "entry" and key == entry.id:
                return {"namespace": ns, "sig": sig, "chain_sha256": cs.split(",") if cs else []}
        return None

    def _checked(self, entry: EntryRecord) -> EntryRecord:
        sigs = [(sig, cs) for ns, sig, cs in self._sigs("entry", entry.id) if ns == entry.namespace]
        if not sigs:
            raise SignatureError(f"entry {entry.id!r} is unsigned; a shared store serves only signed entries")
        sig, cs = sigs[0]
        self.signer.verify_entry(entry, cs.split(",") if cs else [], sig)
        return entry

    def get_entry(self, entry_id: str, namespace: str | None = None) -> EntryRecord:
        if self.namespace is not None:
            if namespace is not None and namespace != self.namespace:
                raise UnknownEntry(f"no entry {entry_id!r} in namespace {namespace!r}")
            namespace = self.namespace
        return self._checked(super().get_entry(entry_id, namespace))

    def list_entries(self, namespace: str | None = None) -> list[EntryRecord]:
        """Signed entries only: unsigned or forged ones are left out (and their ids put in `rejected`),
        so that one bad row cannot deny everyone the rest of the store; `get_entry` raises on them."""
        if self.namespace is not None:
            if namespace is not None and namespace != self.namespace:
                return []
            namespace = self.namespace
        out, rejected = [], []
        for e in super().list_entries(namespace):
            try:
                out.append(self._checked(e))
            except SignatureError:
                rejected.append(e.id)
        self.rejected = rejected
        return out

    def entry_ids(self, namespace: str | None = None) -> list[str]:
        return [e.id for e in self.list_entries(namespace)]

    def namespace_counts(self) -> dict[str, int]:
        """Namespaces with their signed entries (what this store lets a reader see), by name."""
        counts: dict[str, int] = {}
        for e in self.list_entries(None):
            counts[e.namespace] = counts.get(e.namespace, 0) + 1
        return dict(sorted(counts.items()))

    def update_attestation(self, entry_id: str, attestation: dict, verified: bool) -> None:
        """Re-sign with the new attestation, in the same transaction as the update."""
        entry = self.get_entry(entry_id)
        cs = next(c for ns, _, c in self._sigs("entry", entry_id) if ns == entry.namespace)
        now = time.time()
        new = dataclasses.replace(entry, attestation=json.loads(json.dumps(attestation, sort_keys=True)), updated=now)
        chain_sha = cs.split(",") if cs else []
        sig = self.signer.sign_entry(new, chain_sha)
        signature = {"namespace": entry.namespace, "sig": sig, "chain_sha256": chain_sha}
        with self._recorded(new, signature), self._tx() as db:
            db.execute("UPDATE entries SET attestation_json=?, updated=? WHERE id=?",
                       (json.dumps(attestation, sort_keys=True), now, entry_id))
            db.execute("UPDATE signatures SET sig=? WHERE kind='entry' AND key=? AND namespace=?",
                       (sig, entry_id, entry.namespace))
            if verified:
                db.execute("UPDATE blocks SET verified=1 WHERE hash IN "
                           "(SELECT hash FROM entry_blocks WHERE entry_id=?)", (entry_id,))

    def delete_entries(self, entry_ids: Sequence[str]) -> int:
        if self.namespace is not None:
            for eid in entry_ids:
                self.get_entry(eid)  # UnknownEntry for another tenant's ids: nobody deletes across tenants
        n = super().delete_entries(entry_ids)
        with self._tx() as db:
            db.executemany("DELETE FROM signatures WHERE kind='entry' AND key=?", [(e,) for e in entry_ids])
            db.execute("DELETE FROM signatures WHERE kind='block' AND key NOT IN (SELECT hash FROM blocks)")
        return n

    def evict(self, max_bytes: int) -> int:
        freed = super().evict(max_bytes)
        with self._tx() as db:
            db.execute("DELETE FROM signatures WHERE kind='block' AND key NOT IN (SELECT hash FROM blocks)")
        return freed

