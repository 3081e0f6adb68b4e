"""Opening a store from one string: a folder path gives the local store, a redis:// or rediss:// URL the
shared Redis store. This is what `--store`, `KVMEMORY_STORE` and `KVMemory(store=...)` go through.

    open_store("~/my-store")                                   # LocalStore
    open_store("~/my-store", signing_key=KEY)                  # SignedLocalStore (shared folder, signed)
    open_store("redis://10.0.0.5:6379/0?store=team")           # RedisStore, key from KVMEMORY_SIGNING_KEY
    open_store("redis://...?store=team&namespace=alice")       # a tenant's view
    open_store("redis://...?cluster=1")                        # Redis Cluster (any node's address)

Signing for a local folder is off unless a key is given (`signing_key=`) or `KVMEMORY_SIGNED=1` is set
with `KVMEMORY_SIGNING_KEY`: a private folder needs no signatures, a shared one does. A Redis store is
shared by nature and requires a key unless `require_signatures=False`.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvmemory.errors import InvalidInput
from kvmemory.store.protocol import Store

ENV_SIGNED = "KVMEMORY_SIGNED"
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def is_redis_url(spec: object) -> bool:
    return isinstance(spec, str) and spec.strip().lower().startswith(_REDIS_SCHEMES)


def resolve_spec(spec: str | os.PathLike | None) -> str | os.PathLike:
    """The store a spec names, resolved once: None (or blank) is `KVMEMORY_STORE`, else the per-user
    default folder. Every command resolves its store with this, and uses the result everywhere after."""
    if isinstance(spec, bytes):
        try:
            spec = spec.decode()
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"a store path must be text: {exc}") from exc
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        from kvmemory.paths import default_store_path

        return os.environ.get("KVMEMORY_STORE") or default_store_path()
    return spec


def open_store(spec: str | Path | Store | None = None, *, readonly: bool = False,
               signing_key: str | bytes | None = None, namespace: str | None = None, **kw) -> Store:
    """A store for `spec` (a folder, a redis:// / rediss:// URL, or None for `KVMEMORY_STORE` or the default).

    Keyword arguments go to the store's constructor (`path=` / `require_signatures=` / `cluster=` ... for
    Redis). `signing_key` may be a key or a `Signer`; `namespace` scopes the store to one tenant.
    An already opened store object is returned as is.
    """
    if spec is not None and not isinstance(spec, (str, bytes, os.PathLike)):
        if isinstance(spec, Store):
            return spec  # already a store
        raise InvalidInput(f"a store is a folder path or a redis:// URL, got {type(spec).__name__}")
    spec = resolve_spec(spec)
    if is_redis_url(spec):
        from kvmemory.store.redis_store import RedisStore

        return RedisStore(str(spec).strip(), readonly=readonly, signer=signing_key, namespace=namespace, **kw)
    from kvmemory.store.signing import Signer

    signer = Signer.resolve(signing_key) if signing_key is not None else None
    if signer is None and os.environ.get(ENV_SIGNED, "").lower() in ("1", "true", "yes"):
        signer = Signer.from_env()
        if signer is None:
            from kvmemory.store.signing import ENV_KEY, SigningKeyError

            raise SigningKeyError(f"{ENV_SIGNED} is set but {ENV_KEY} is not: a signed store needs a key")
    if signer is not None or namespace is not None:
        if signer is None:
            raise InvalidInput("a namespace-scoped local store is a signed store: give a signing key too")
        from kvmemory.store.signing import SignedLocalStore

        return SignedLocalStore(spec, signer=signer, namespace=namespace, readonly=readonly, **kw)
    from kvmemory.store.local import LocalStore

    return LocalStore(spec, readonly=readonly, **kw)
