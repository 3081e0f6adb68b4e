"""API keys, tenants, and the scope of a call (`user_id`, `agent_id`, `run_id`) mapped onto a namespace.

Scopes. Agent-memory users name what a memory belongs to by user, agent and run (mem0's
`user_id` / `agent_id` / `run_id`); kvmemory isolates by namespace. A scope maps onto exactly one
namespace, and different scopes never share one:

    user_id=alice                          -> "user:alice"
    user_id=alice, agent_id=planner        -> "user:alice/agent:planner"
    agent_id=planner, run_id=r1            -> "agent:planner/run:r1"
    namespace="team-a" (given as it is)    -> "team-a"   (a plain name: no ":" or "/")

Each part is 1-128 characters of letters, digits and `._@-`, so no two scopes can spell the same
namespace and no id can smuggle a separator in. A namespace holds its own entries and its own router
index (routing/router.py): recall, answer and chat routing in one scope never see another's entries.
Nothing is inherited: `user:alice` does not see `user:alice/agent:planner`'s entries.

Keys. Without keys the server is open (every scope, no credentials; for a trusted local machine).
`--api-key` / `KVMEMORY_API_KEY` are admin keys: every namespace. A keys file maps tenant keys to
what they may use:

    {"keys": [
      {"name": "alice", "key": "sk-alice-...", "user_ids": ["alice"]},
      {"name": "team-a", "key_sha256": "<hex of SHA-256(key)>", "namespaces": ["team-a", "team-a-*"]},
      {"name": "ops", "key": "sk-ops-...", "admin": true}
    ]}

A tenant key may use the scopes whose `user_id` it lists (with any agent / run under them) and the
namespaces matching its patterns (fnmatch), nothing else; a call that names no scope gets the key's
only user id or only literal namespace, when it has exactly one. A scope the key may not use is
refused with 403 before anything is read; an entry id from another namespace reads as 404, the same
as an id that does not exist. Keys are compared in constant time, by SHA-256.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvmemory.errors import InvalidInput
from kvmemory.memory.facade import DEFAULT_NAMESPACE

_PART = re.compile(r"^[A-Za-z0-9._@-]{1,128}$")
SCOPE_KEYS = ("user_id", "agent_id", "run_id")


class AuthError(Exception):
    """No key, or an unknown one (HTTP 401)."""


class Forbidden(Exception):
    """A key that may not use the scope it asked for (HTTP 403)."""


def _check_part(name: str, value: object) -> str:
    if not isinstance(value, str) or not _PART.match(value):
        raise InvalidInput(f"{name} must be 1-128 characters of letters, digits and ._@- (got {value!r})")
    return value


@dataclass(slots=True, frozen=True)
class Scope:
    """What a call's memory belongs to: user / agent / run ids, or a namespace named as it is."""

    user_id: str | None = None
    agent_id: str | None = None
    run_id: str | None = None
    namespace: str | None = None

    @classmethod
    def of(cls, values: Mapping[str, object] | None) -> "Scope":
        """The scope named in a request's fields (`user_id`, `agent_id`, `run_id`, `namespace`)."""
        values = values or {}
        parts = {k: _check_part(k, values[k]) for k in SCOPE_KEYS if values.get(k) is not None}
        ns = values.get("namespace")
        if ns is not None:
            _check_part("namespace", ns)
            if parts:
                raise InvalidInput("give a namespace or user_id / agent_id / run_id, not both")
        return cls(**parts, namespace=ns)

    @property
    def empty(self) -> bool:
        return not (self.user_id or self.agent_id or self.run_id or self.namespace)

    def to_namespace(self) -> str:
        if self.namespace:
            return self.namespace
        parts = [f"{k.removesuffix('_id')}:{v}" for k, v in
                 (("user_id", self.user_id), ("agent_id", self.agent_id), ("run_id", self.run_id)) if v]
        return "/".join(parts) if parts else DEFAULT_NAMESPACE

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in (*SCOPE_KEYS, "namespace") if getattr(self, k)}
        out["namespace"] = self.to_namespace()
        return out


def scope_of_namespace(namespace: str) -> dict:
    """The scope fields a namespace was made from (for listing entries back to their owners)."""
    if ":" not in namespace:
        return {"namespace": namespace}
    out = {}
    for part in namespace.split("/"):
        key, _, value = part.partition(":")
        out[f"{key}_id"] = value
    return {**out, "namespace": namespace}


@dataclass(slots=True, frozen=True)
class Principal:
    """Who is calling and what they may use."""

    name: str
    admin: bool = False
    user_ids: tuple[str, ...] = ()
    namespaces: tuple[str, ...] = ()  # fnmatch patterns

    def may_use(self, scope: Scope) -> bool:
        if self.admin:
            return True
        if scope.user_id is not None and scope.user_id in self.user_ids:
            return True
        ns = scope.to_namespace()
        return not scope.empty and any(fnmatch.fnmatchcase(ns, pat) for pat in self.namespaces)

    def default_scope(self) -> Scope | None:
        """The scope a call that names none gets: the key's only user id, else its only literal
        namespace; for an admin (or an open server) the default namespace."""
        if self.admin:
            return Scope()
        literal = [p for p in self.namespaces if not any(c in p for c in "*?[")]
        if len(self.user_ids) == 1 and not self.namespaces:
            return Scope(user_id=self.user_ids[0])
        if len(literal) == 1 and not self.user_ids and len(self.namespaces) == 1:
            return Scope(namespace=literal[0])
        return None

    def resolve(self, values: Mapping[str, object] | None) -> Scope:
        """The scope of a call (its fields, else the key's default), checked against the key."""
        scope = Scope.of(values)
        if scope.empty:
            default = self.default_scope()
            if default is None:
                raise Forbidden(f"key {self.name!r} may use several scopes: name one (user_id, agent_id, "
                                "run_id or namespace)")
            scope = default
        if not self.may_use(scope):
            raise Forbidden(f"key {self.name!r} may not use namespace {scope.to_namespace()!r}")
        return scope


OPEN = Principal("open", admin=True)  # a server started without keys


def _sha256(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


@dataclass(slots=True)
class KeyRing:
    """The keys a server accepts, by SHA-256 of the key."""

    by_hash: dict[bytes, Principal] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        return not self.by_hash

    def add(self, key_hash: bytes, principal: Principal) -> None:
        if key_hash in self.by_hash:
            raise InvalidInput(f"key of {principal.name!r} is given twice")
        self.by_hash[key_hash] = principal

    def authenticate(self, key: str | None) -> Principal:
        if self.open:
            return OPEN
        if not key:
            raise AuthError("missing API key: this server needs one; send it as 'Authorization: Bearer <key>'")
        digest = _sha256(key)
        found = None
        for h, p in self.by_hash.items():  # constant time per comparison, every key compared
            if hmac.compare_digest(h, digest):
                found = p
        if found is None:
            raise AuthError("invalid API key: the key sent is not one of this server's keys (kvmemory serve "
                            "--api-key / --keys-file)")
        return found


def load_keys_file(path: str | Path) -> list[tuple[bytes, Principal]]:
    """The tenant keys of a keys file (see the module docstring); raises InvalidInput naming what is wrong."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"cannot read the keys file {path}: {exc}") from exc
    items = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise InvalidInput(f'{path}: expected {{"keys": [...]}}')
    out = []
    for i, item in enumerate(items):
        where = f"{path}: keys[{i}]"
        if not isinstance(item, dict):
            raise InvalidInput(f"{where} is not an object")
        name = str(item.get("name") or f"key{i}")
        if ("key" in item) == ("key_sha256" in item):
            raise InvalidInput(f"{where} ({name}): give exactly one of key, key_sha256")
        if "key" in item:
            if not isinstance(item["key"], str) or len(item["key"]) < 8:
                raise InvalidInput(f"{where} ({name}): a key needs at least 8 characters")
            digest = _sha256(item["key"])
        else:
            try:
                digest = bytes.fromhex(str(item["key_sha256"]))
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise InvalidInput(f"{where} ({name}): key_sha256 must be 64 hex digits")
        user_ids = tuple(_check_part("user_ids[]", u) for u in _strings(item.get("user_ids", []), where))
        namespaces = tuple(_strings(item.get("namespaces", []), where))
        admin = item.get("admin", False) is True
        if not (admin or user_ids or namespaces):
            raise InvalidInput(f"{where} ({name}): give user_ids, namespaces or admin: true")
        out.append((digest, Principal(name, admin, user_ids, namespaces)))
    return out


def _strings(value: object, where: str) -> Iterable[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise InvalidInput(f"{where}: user_ids and namespaces are lists of strings")
    return value


def build_keyring(api_keys: Iterable[str], keys_file: str | None) -> KeyRing:
    ring = KeyRing()
    for i, key in enumerate(k for k in api_keys if k):
        ring.add(_sha256(key), Principal(f"admin{i}" if i else "admin", admin=True))
    if keys_file:
        for digest, principal in load_keys_file(keys_file):
            ring.add(digest, principal)
    return ring


def bearer_key(headers: Mapping[str, str]) -> str | None:
    """The key of a request: `Authorization: Bearer <key>` (as OpenAI clients send it) or `X-API-Key`."""
    auth = headers.get("authorization") or ""
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return headers.get("x-api-key") or None
