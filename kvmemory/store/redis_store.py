"""The shared store on Redis: blocks and catalogue in a Redis server (or Redis Cluster), signed entries,
namespaced tenants, and a local read-through tier that keeps serving while Redis is away.

    store = RedisStore("redis://127.0.0.1:6379/0?store=team")      # key from KVMEMORY_SIGNING_KEY
    engine = Engine(loaded, store)                                  # same interface as LocalStore

Key layout (`<s>` is the store name, `[A-Za-z0-9_.-]{1,64}`; everything in braces is a Redis Cluster
hash tag, so keys with the same tag live in the same slot):

    kvm:{<s>}:meta              hash   format, created
    kvm:{<s>}:prof              hash   profile_id -> profile JSON
    kvm:{<s>}:b:<hash>          hash   a block row: hash parent profile_id idx n_tokens payload_sha256
                                       payload_nbytes file_nbytes verified pinned quarantined refs created
                                       last_used, and one `sig.<namespace>` per namespace that stored it
    kvm:{<s>}:blocks            zset   block hash -> last use (LRU order; the list of rows)
    kvm:{<s>}:e:<id>            hash   an entry: id namespace problem solution answer(JSON) verifier(JSON)
                                       verified token_ids(<u4 bytes) profile_id attestation(JSON) meta(JSON)
                                       created updated chain(hashes, comma separated) chain_sha(payload
                                       SHA-256s, comma separated) sig
    kvm:{<s>}:entries           zset   entry id -> created
    kvm:{<s>}:ns:<namespace>    zset   entry id -> created, one per namespace
    kvm:{<s>}:damaged           hash   entry id -> why (marked by `kvmemory fsck --repair`)
    kvm:{<s>}:qlog              list   quarantine log (JSON: hash, reason, at)
    kvm:{<s>}:qe:<id>           hash   an entry set aside by fsck (unsigned, forged or unreadable)
    kvm:{<s>}:r:<id>            string the entry's record (store/records.py: JSON, its own SHA-256, the
                                       entry's signature), written in the same script as the entry: the
                                       second copy `kvmemory fsck --repair` puts a damaged or lost entry
                                       back from
    kvm:{<s>}:qr:<id>           string a damaged record set aside by fsck
    kvm:{<s>}:seq               string the change feed's last sequence number (INCR'd by the scripts)
    kvm:{<s>}:feed              stream the change feed (store/feed.py): id `<seq>-0`, fields op, id, ns;
                                       written in the commit and delete scripts, the last FEED_KEEP kept
    kvm:<s>:p:{<hash>}          string a block file (blocks.py format: header + raw payload bytes)
    kvm:<s>:qp:{<hash>}         string a quarantined block file (same slot as its payload key)
    kvm:<s>:op:{<hash>}         string an orphan payload set aside by fsck (removed on request only)

The catalogue (rows and entries: metadata, a few hundred bytes per block) shares one tag, so every
multi-key update is one atomic Lua script in one slot, on a single server or a cluster alike; the block
payloads (the bulk: megabytes each) are tagged by their own hash and spread over every slot. Payloads
are raw bytes (no pickle, no base64).

Guarantees (the local store's, over the network):
- Atomic entries: payloads are written first (single SETs), then the entry, its chain and its block rows
  in one Lua script (declared `#!lua`, so Redis refuses it whole when out of memory rather than half
  way). A writer killed at any point leaves at most orphan payloads (`kvmemory fsck --repair` sets them
  aside), never a partial entry.
- Verified reads: every payload is checked (canonical header, sizes, SHA-256) against its catalogue row
  before a byte reaches the model; damage quarantines the block for everyone.
- Signed (shared mode, the default): each entry and each block row is signed (signing.py); unsigned or
  forged ones are refused, so a block reachable only through a forged row is never grafted.
- Namespaces: a store opened with `namespace=` sees only that namespace's entries, and only blocks that
  namespace stored (signed); bytes shared by tenants are still stored once.
- Outages: when Redis goes away, writes raise `StoreUnavailable` (nothing partial is left), reads are
  served from the local tier (blocks and entries read before, verified as always), and the store goes
  back to Redis by itself once it answers again (retried at most every `retry_interval` seconds).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np
import torch

from kvmemory.store import drops
from kvmemory.store.blocks import BlockMeta, encode_header, parse_header
from kvmemory.store.feed import FEED_KEEP, Change, FeedHead
from kvmemory.errors import IntegrityError, InvalidInput, StoreError, StoreFull, StoreReadOnly, UnknownEntry
from kvmemory.store.signing import ENV_KEY, SignatureError, Signer, SigningKeyError
from kvmemory.store.local import BlockRow, EntryRecord, LocalStore, StoreStats, block_row_from, check_meta, entry_from_fields

log = logging.getLogger("kvmemory.redis")

REDIS_FORMAT = 1
_STORE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_OUR_PARAMS = {"store", "cluster", "tier", "namespace"}
_BLOCK_INT_FIELDS = ("idx", "n_tokens", "payload_nbytes", "file_nbytes", "verified", "pinned", "quarantined")


class StoreUnavailable(StoreError):
    """The Redis server does not answer. Nothing partial was written; reads fall back to the local tier."""


def _redis():
    try:
        import redis
    except ImportError as exc:  # pragma: no cover - redis is a declared extra
        raise StoreError("the Redis store needs the `redis` package: pip install 'kvmemory[redis]'") from exc
    return redis


def _errors():
    r = _redis()
    e = r.exceptions
    unavailable = (e.ConnectionError, e.TimeoutError, e.ClusterDownError, e.MasterDownError, e.TryAgainError,
                   e.SlotNotCoveredError)
    return unavailable, e.OutOfMemoryError, e.ReadOnlyError, e.ResponseError, e.RedisError


# Block upsert shared by the scripts: the local store's `INSERT ... ON CONFLICT DO UPDATE` semantics
# (un-quarantine, new payload hash, verified/pinned only ever raised, last use now), plus a signature.
_LUA_UPSERT = """
local function upsert(k, zblocks, now, a)
  local h, parent, prof, idx, ntok, sha, nbytes, fbytes, ver, pin, sigf, sigv = unpack(ARGV, a, a + 11)
  if redis.call('EXISTS', k) == 0 then
    redis.call('HSET', k, 'created', now, 'refs', 0, 'verified', 0, 'pinned', 0)
  end
  redis.call('HSET', k, 'hash', h, 'parent', parent, 'profile_id', prof, 'idx', idx, 'n_tokens', ntok,
             'payload_sha256', sha, 'payload_nbytes', nbytes, 'file_nbytes', fbytes, 'quarantined', 0,
             'last_used', now)
  if ver == '1' then redis.call('HSET', k, 'verified', 1) end
  if pin == '1' then redis.call('HSET', k, 'pinned', 1) end
  if sigf ~= '' then redis.call('HSET', k, sigf, sigv) end
  redis.call('ZADD', zblocks, now, h)
  return a + 12
end
"""

# One change feed record (store/feed.py), in the script that makes the change.
_LUA_FEED = """
local function feed(kseq, kfeed, op, id, ns)
  local seq = redis.call('INCR', kseq)
  redis.call('XADD', kfeed, 'MAXLEN', '~', '""" + str(FEED_KEEP) + """', seq .. '-0', 'op', op, 'id', id, 'ns', ns)
end
"""

# KEYS: feed seq, feed stream; ARGV: op, id, namespace. A change made outside the scripts (fsck's repairs).
_LUA_NOTE = "#!lua\n" + _LUA_FEED + """
feed(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3])
return 'ok'
"""

# KEYS: entry, entries zset, ns zset, blocks zset, nb block rows, nc chain rows, no old-chain rows, record,
#       feed seq, feed stream
# ARGV: now, id, namespace, created, expected old chain ('-' = absent), nb, nc, no, nf, nf field/value
#       pairs, then nb x 12 block values, then the record
_LUA_COMMIT = "#!lua\n" + _LUA_UPSERT + _LUA_FEED + """
local now, id, ns, created, expect = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local nb, nc, no, nf = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local old_ns = redis.call('HGET', KEYS[1], 'namespace')
local old_chain = '-'
if old_ns then old_chain = redis.call('HGET', KEYS[1], 'chain') or '' end
if old_chain ~= expect then return 'retry' end
if old_ns and old_ns ~= ns then return 'nsconflict' end
local fields = {}
local a = 10
for i = 1, nf do fields[#fields + 1] = ARGV[a]; fields[#fields + 1] = ARGV[a + 1]; a = a + 2 end
for i = 1, nb do a = upsert(KEYS[4 + i], KEYS[4], now, a) end
for i = 1, no do
  local k = KEYS[4 + nb + nc + i]
  if redis.call('EXISTS', k) == 1 then redis.call('HINCRBY', k, 'refs', -1) end
end
for i = 1, nc do
  local k = KEYS[4 + nb + i]
  if redis.call('EXISTS', k) == 1 then redis.call('HINCRBY', k, 'refs', 1) end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('ZADD', KEYS[2], created, id)
redis.call('ZADD', KEYS[3], created, id)
redis.call('SET', KEYS[#KEYS - 2], ARGV[#ARGV])
feed(KEYS[#KEYS - 1], KEYS[#KEYS], 'put', id, ns)
return 'ok'
"""

# KEYS: blocks zset, nb rows; ARGV: now, nb x 12 block values
_LUA_PUT_BLOCKS = "#!lua\n" + _LUA_UPSERT + """
local a = 2
for i = 1, #KEYS - 1 do a = upsert(KEYS[1 + i], KEYS[1], ARGV[1], a) end
return 'ok'
"""

# KEYS: entries zset, blocks zset, damaged hash, then per entry (entry key, ns zset, record), then chain rows,
#       then feed seq, feed stream
# ARGV: ne, then per entry (id, expected chain ('-' = absent), namespace), then per chain row (hash, decrement)
# Returns the hashes whose rows were removed (their payloads are deleted by the caller: other slots).
_LUA_DELETE = "#!lua\n" + _LUA_FEED + """
local ne = tonumber(ARGV[1])
local a = 2
for i = 1, ne do
  local k = KEYS[3 + 3 * i - 2]
  local chain = '-'
  if redis.call('EXISTS', k) == 1 then chain = redis.call('HGET', k, 'chain') or '' end
  if chain ~= ARGV[a + 1] then return {'retry'} end
  a = a + 3
end
a = 2
for i = 1, ne do
  local id = ARGV[a]
  local existed = redis.call('DEL', KEYS[3 + 3 * i - 2])
  redis.call('ZREM', KEYS[1], id)
  redis.call('ZREM', KEYS[3 + 3 * i - 1], id)
  redis.call('DEL', KEYS[3 + 3 * i])
  redis.call('HDEL', KEYS[3], id)
  if existed == 1 then feed(KEYS[#KEYS - 1], KEYS[#KEYS], 'del', id, ARGV[a + 2]) end
  a = a + 3
end
local gone = {'ok'}
for i = 3 + 3 * ne + 1, #KEYS - 2 do
  local k = KEYS[i]
  local h, dec = ARGV[a], tonumber(ARGV[a + 1])
  a = a + 2
  if redis.call('EXISTS', k) == 1 then
    local refs = redis.call('HINCRBY', k, 'refs', -dec)
    if refs <= 0 and redis.call('HGET', k, 'pinned') ~= '1' then
      redis.call('DEL', k)
      redis.call('ZREM', KEYS[2], h)
      gone[#gone + 1] = h
    end
  end
end
return gone
"""

# KEYS: blocks zset, rows; ARGV: hashes. Deletes the rows still neither pinned nor verified.
_LUA_EVICT = """#!lua
local out = {}
for i = 2, #KEYS do
  local k = KEYS[i]
  local p, v, n = unpack(redis.call('HMGET', k, 'pinned', 'verified', 'file_nbytes'))
  if p == '0' and v == '0' then
    redis.call('DEL', k)
    redis.call('ZREM', KEYS[1], ARGV[i - 1])
    out[#out + 1] = ARGV[i - 1]
    out[#out + 1] = n
  end
end
return out
"""

# KEYS: row, qlog; ARGV: log line. Marks an existing row quarantined (a deleted row is not recreated).
_LUA_QUARANTINE = """#!lua
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'quarantined', 1) end
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('LTRIM', KEYS[2], -10000, -1)
return 'ok'
"""

# KEYS: entry, record, chain rows...; ARGV: expected sig, attestation JSON, updated, new sig, verified flag,
# the new record
_LUA_ATTEST = """#!lua
if redis.call('EXISTS', KEYS[1]) == 0 then return 'gone' end
if (redis.call('HGET', KEYS[1], 'sig') or '') ~= ARGV[1] then return 'retry' end
redis.call('HSET', KEYS[1], 'attestation', ARGV[2], 'updated', ARGV[3], 'sig', ARGV[4])
redis.call('SET', KEYS[2], ARGV[6])
if ARGV[5] == '1' then
  for i = 3, #KEYS do
    if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('HSET', KEYS[i], 'verified', 1) end
  end
end
return 'ok'
"""


def parse_url(url: str) -> tuple[str, dict]:
    """Split kvmemory's own query parameters (store, cluster, tier, namespace) from a redis:// URL."""
    parts = urlsplit(str(url))
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise InvalidInput(f"not a Redis URL: {url!r} (redis://host:port/db?store=NAME, rediss:// for TLS)")
    ours, theirs = {}, []
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        (ours.__setitem__(k, v) if k in _OUR_PARAMS else theirs.append((k, v)))
    return urlunsplit(parts._replace(query=urlencode(theirs))), ours


def _redacted(url: str) -> str:
    p = urlsplit(url)
    host = p.hostname or ""
    netloc = f"{host}:{p.port}" if p.port else host
    return urlunsplit((p.scheme, netloc, p.path, "", ""))


def _s(v: bytes | None) -> str | None:
    return None if v is None else v.decode("utf-8")


class RedisStore:
    """A kvmemory store in Redis (see the module docstring for the layout and the guarantees).

    url:          redis://[user:pass@]host:port/db[?store=NAME&cluster=1&tier=PATH&namespace=NS], rediss://
                  for TLS. Query parameters of kvmemory are stripped; the rest go to redis-py.
    store:        store name (several stores can share one server); default "default".
    path:         the local tier folder (a LocalStore used as a read-through cache; the router folder
                  lives there too). Default: a folder per server, store and namespace in the cache dir.
    signer:       a Signer or a key; default: KVMEMORY_SIGNING_KEY. Required unless
                  require_signatures=False (a trusted, single-user server).
    namespace:    scope this store to one tenant (see signing.py).
    client:       an existing redis-py client (Redis or RedisCluster) instead of the URL's.
    """

    kind = "redis"

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, store: str | None = None,
                 path: str | Path | None = None, readonly: bool = False,
                 signer: Signer | str | bytes | None = None, require_signatures: bool = True,
                 namespace: str | None = None, cluster: bool | None = None, client=None,
                 socket_timeout: float = 5.0, connect_timeout: float = 2.0, retry_interval: float = 1.0,
                 allow_wiped: bool = False):
        redis = _redis()
        clean_url, ours = parse_url(url)
        self.url = _redacted(clean_url)
        self.name = store or ours.get("store") or "default"
        if not _STORE_NAME.fullmatch(self.name):
            raise InvalidInput(f"a Redis store name is 1-64 of [A-Za-z0-9_.-], got {self.name!r}")
        self.readonly = readonly
        self.signer = Signer.resolve(signer)
        if self.signer is None and require_signatures:
            raise SigningKeyError(
                f"a shared Redis store signs its entries: set {ENV_KEY} (hex or text, >= 16 bytes) or pass "
                "signing_key=; for a trusted single-user server pass require_signatures=False")
        ns = namespace or ours.get("namespace") or None
        if ns is not None and self.signer is not None and self.signer.scope not in (None, ns):
            raise SigningKeyError(f"the key given holds namespace {self.signer.scope!r}, not {ns!r}")
        self.namespace = ns or (self.signer.scope if self.signer is not None else None)
        self.rejected: list[str] = []
        self.retry_interval = float(retry_interval)
        self.degraded = False
        self.last_error: str | None = None
        self._down_until = 0.0
        self._vouched: OrderedDict[str, str] = OrderedDict()
        self._vlock = threading.Lock()
        (self._unavailable, self._oom, self._ro_err, self._resp_err, self._redis_err) = _errors()
        if cluster is None:
            cluster = ours.get("cluster", "").lower() in ("1", "true", "yes")
        self.cluster = bool(cluster) or (client is not None and type(client).__name__ == "RedisCluster")
        if client is None:
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            kw = dict(socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout)
            if self.cluster:
                from redis.cluster import RedisCluster

                client = RedisCluster.from_url(clean_url, **kw)
            else:
                # One immediate retry re-dials a pooled connection the server dropped (e.g. a restart);
                # more would only stretch an outage into long stalls.
                client = redis.Redis.from_url(clean_url, retry=Retry(NoBackoff(), 1), **kw)
        self._r = client
        tag = "{" + self.name + "}"
        self._pre = f"kvm:{tag}:"
        self._ppre = f"kvm:{self.name}:"
        self._scripts = {n: client.register_script(src) for n, src in (
            ("commit", _LUA_COMMIT), ("put", _LUA_PUT_BLOCKS), ("delete", _LUA_DELETE), ("evict", _LUA_EVICT),
            ("quarantine", _LUA_QUARANTINE), ("attest", _LUA_ATTEST), ("note", _LUA_NOTE))}
        if path is None and ours.get("tier"):
            path = ours["tier"]  # ?tier=PATH in the URL (documented above; it was parsed, never used)
        self.path = Path(path).expanduser() if path is not None else self._default_tier()
        self._tier = LocalStore(self.path, records=False)  # a cache: no entry records
        self.wiped: str | None = None  # why Redis lost this store while the tier still holds it (see _check_format)
        self._check_format(allow_wiped)

    # ------------------------------------------------------------------ keys
    def k_meta(self) -> str:
        return self._pre + "meta"

    def k_prof(self) -> str:
        return self._pre + "prof"

    def k_block(self, h: str) -> str:
        return f"{self._pre}b:{h}"

    def k_blocks(self) -> str:
        return self._pre + "blocks"

    def k_entry(self, eid: str) -> str:
        return f"{self._pre}e:{eid}"

    def k_entries(self) -> str:
        return self._pre + "entries"

    def k_ns(self, ns: str) -> str:
        return f"{self._pre}ns:{ns}"

    def k_damaged(self) -> str:
        return self._pre + "damaged"

    def k_qlog(self) -> str:
        return self._pre + "qlog"

    def k_qentry(self, eid: str) -> str:
        return f"{self._pre}qe:{eid}"

    def k_payload(self, h: str) -> str:
        return f"{self._ppre}p:{{{h}}}"

    def k_record(self, eid: str) -> str:
        return f"{self._pre}r:{eid}"

    def k_qrecord(self, eid: str) -> str:
        return f"{self._pre}qr:{eid}"

    def k_seq(self) -> str:
        return self._pre + "seq"

    def k_feed(self) -> str:
        return self._pre + "feed"

    def k_orphan(self, h: str) -> str:
        return f"{self._ppre}op:{{{h}}}"

    def k_qpayload(self, h: str) -> str:
        return f"{self._ppre}qp:{{{h}}}"

    @property
    def client(self):
        return self._r

    def _default_tier(self) -> Path:
        from kvmemory.paths import cache_dir

        ident = json.dumps([self.url, self.name, self.namespace])
        return cache_dir() / "redis-tier" / hashlib.sha256(ident.encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ availability
    def _online(self) -> bool:
        return time.monotonic() >= self._down_until

    def _went_down(self, exc: Exception) -> None:
        self._down_until = time.monotonic() + self.retry_interval
        if not self.degraded:
            log.warning("Redis at %s is unreachable (%s); serving reads from the local tier %s", self.url, exc,
                        self.path)
        self.degraded = True
        self.last_error = f"{type(exc).__name__}: {exc}"

    def _came_back(self) -> None:
        if self.degraded:
            log.warning("Redis at %s answers again; back to the shared store", self.url)
        self.degraded = False

    def _unavailable_error(self, what: str, exc: Exception | None = None) -> StoreUnavailable:
        why = f" ({type(exc).__name__}: {exc})" if exc is not None else f" (last error: {self.last_error})"
        return StoreUnavailable(
            f"Redis at {self.url} is unreachable{why}: {what} did not happen (nothing partial is visible: entries "
            f"commit atomically). Reads are served from the local tier {self.path}; retry when the server is back.")

    def _read(self, fn, what: str):
        """Run a read against Redis; None (after noting the outage) when it is unreachable."""
        if not self._online():
            return None
        try:
            out = fn()
        except self._unavailable as exc:
            self._went_down(exc)
            return None
        except self._resp_err as exc:
            raise IntegrityError(f"Redis refused {what} ({exc}): a damaged key; run `kvmemory fsck`") from exc
        except self._redis_err as exc:
            raise StoreError(f"Redis error during {what}: {exc}") from exc
        self._came_back()
        return (out,)

    def _write(self, fn, what: str):
        """Run a write against Redis; typed errors for outages, a full server and read-only replicas."""
        if self.readonly:
            raise StoreReadOnly(f"this Redis store ({self.url}, store {self.name!r}) was opened read-only")
        if not self._online():
            raise self._unavailable_error(what)
        try:
            out = fn()
        except self._unavailable as exc:
            self._went_down(exc)
            raise self._unavailable_error(what, exc) from exc
        except self._oom as exc:
            raise StoreFull(f"Redis at {self.url} is out of memory (maxmemory): {what} was refused whole, nothing "
                            f"partial is visible ({exc})") from exc
        except self._ro_err as exc:
            raise StoreReadOnly(f"Redis at {self.url} is a read-only replica: {what} refused ({exc})") from exc
        except self._redis_err as exc:
            raise StoreError(f"Redis error during {what}: {exc}") from exc
        self._came_back()
        return out

    def _fetch(self, fn, what: str):
        """A read that must reach Redis (accounting, maintenance): StoreUnavailable when it cannot."""
        got = self._read(fn, what)
        if got is None:
            raise self._unavailable_error(what)
        return got[0]

    def ping(self) -> bool:
        """Ask Redis now (ignoring the retry interval); True when it answers (the store is then back)."""
        self._down_until = 0.0
        return self._read(self._r.ping, "ping") is not None

    # The generation: a random token in the meta hash, made with the store, and copied into the local tier
    # (GENERATION_FILE). A Redis that lost the store (FLUSHALL, a restart without persistence, another
    # server behind the same address) lacks it, or holds another one, while the tier still remembers it:
    # the loss is noticed (CatalogueLost; `kvmemory fsck` names it, `fsck --repair` restores the entries
    # the tier holds), never shown as an empty store.
    GENERATION_FILE = "redis-generation"

    def _tier_generation(self) -> str | None:
        try:
            return (self.path / self.GENERATION_FILE).read_text(encoding="ascii").strip() or None
        except (OSError, UnicodeDecodeError):
            return None

    def _remember_generation(self, gen: str) -> None:
        if self._tier.readonly or self._tier_generation() == gen:
            return
        try:
            tmp = self.path / f"{self.GENERATION_FILE}.tmp"
            tmp.write_text(gen, encoding="ascii")
            tmp.replace(self.path / self.GENERATION_FILE)
        except OSError as exc:
            log.debug("local tier generation not written: %s", exc)

    def _tier_holds_entries(self) -> bool:
        try:
            return bool(self._tier._q("SELECT 1 FROM entries LIMIT 1"))
        except StoreError:
            return False

    def new_generation(self) -> str:
        """Start a new generation (a store created, or restored by fsck): written to Redis and the tier."""
        import secrets

        gen = secrets.token_hex(16)
        self._write(lambda: self._r.hset(self.k_meta(), mapping={"format": REDIS_FORMAT, "generation": gen}),
                    "writing the store generation")
        self._remember_generation(gen)
        self.wiped = None
        return gen

    def _check_format(self, allow_wiped: bool = False) -> None:
        got = self._read(lambda: self._r.hmget(self.k_meta(), "format", "generation"), "reading the store format")
        if got is None:
            log.warning("Redis at %s is unreachable at open; serving the local tier %s", self.url, self.path)
            return
        fmt, gen = got[0]
        gen = gen.decode("ascii", "replace") if isinstance(gen, bytes) else None
        known = self._tier_generation()
        if known is not None and gen != known and self._tier_holds_entries():
            self.wiped = (f"Redis at {self.url} " + ("no longer holds store " if fmt is None else
                          "holds another generation of store ") + f"{self.name!r}, while the local tier "
                          f"{self.path} still holds its entries (a FLUSHALL, a restart without persistence, or "
                          "another server at this address)")
            if not allow_wiped:
                from kvmemory.errors import CatalogueLost

                raise CatalogueLost(f"{self.wiped}: nothing is served as if the store were empty. Run `kvmemory "
                                    "fsck --repair` to restore the entries from the local tier")
            return
        if not self.readonly:  # the change feed's id: new with every store (a server that lost its data too)
            self._write(lambda: self._r.hsetnx(self.k_meta(), "feed_id", uuid.uuid4().hex), "naming the change feed")
        if fmt is None:
            if not self.readonly:
                self._write(lambda: self._r.hsetnx(self.k_meta(), "format", REDIS_FORMAT), "creating the store")
                self._ensure_generation()
            return
        try:
            n = int(fmt)
        except ValueError as exc:
            raise StoreError(f"store {self.name!r} at {self.url} has an unreadable format marker {fmt!r}") from exc
        if n > REDIS_FORMAT:
            from kvmemory.errors import StoreFormatError

            raise StoreFormatError(f"store {self.name!r} at {self.url} was written by a newer kvmemory (format {n}; "
                                   f"this version reads up to {REDIS_FORMAT}). Upgrade kvmemory to use it.")
        if gen is None:  # a store made before generations: given one now
            if not self.readonly:
                self._ensure_generation()
            return
        self._remember_generation(gen)

    def _ensure_generation(self) -> None:
        """Give the store a generation unless another writer already did (HSETNX), and remember it."""
        import secrets

        token = secrets.token_hex(16)
        self._write(lambda: self._r.hsetnx(self.k_meta(), "generation", token), "writing the store generation")
        got = self._read(lambda: self._r.hget(self.k_meta(), "generation"), "reading the store generation")
        if got and got[0]:
            self._remember_generation(got[0].decode("ascii", "replace"))

    def close(self) -> None:
        try:
            self._r.close()
        except Exception:  # noqa: BLE001 - closing a dead connection must not fail
            pass
        self._tier.close()

    # ------------------------------------------------------------------ profiles
    def put_profile(self, profile_id: str, profile: dict) -> None:
        body = json.dumps(profile, sort_keys=True)
        self._write(lambda: self._r.hsetnx(self.k_prof(), profile_id, body), "storing the execution profile")
        self._tier_safe(lambda: self._tier.put_profile(profile_id, profile))

    def get_profile(self, profile_id: str) -> dict | None:
        got = self._read(lambda: self._r.hget(self.k_prof(), profile_id), "reading a profile")
        if got is None:
            return self._tier.get_profile(profile_id)
        if got[0] is None:
            return None
        try:
            d = json.loads(got[0])
            if not isinstance(d, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            raise IntegrityError(f"the stored profile {profile_id[:12]} is damaged ({exc})") from exc
        self._tier_safe(lambda: self._tier.put_profile(profile_id, d))
        return d

    # ------------------------------------------------------------------ tier
    def _tier_safe(self, fn) -> None:
        """The tier is a cache: failing to fill it (a full local disk) never fails the operation."""
        if self._tier.readonly:
            return
        try:
            fn()
        except (StoreError, OSError) as exc:
            log.debug("local tier not updated: %s", exc)

    def _vouch(self, row: BlockRow) -> None:
        with self._vlock:
            self._vouched[row.hash] = row.payload_sha256
            self._vouched.move_to_end(row.hash)
            while len(self._vouched) > 200_000:
                self._vouched.popitem(last=False)

    def _vouched_for(self, row: BlockRow) -> bool:
        with self._vlock:
            return self._vouched.get(row.hash) == row.payload_sha256

    # ------------------------------------------------------------------ block rows
    def block_path(self, h: str) -> Path:
        """Where the local tier keeps block `h` (a cache of the payload held in Redis)."""
        return self._tier.block_path(h)

    def parse_block_row(self, h: str, raw: dict) -> tuple[BlockRow, dict[str, str]]:
        """A type-checked BlockRow and the row's signatures {namespace: sig} from a row's Redis hash."""
        try:
            d = {k.decode(): v.decode() for k, v in raw.items()}
            vals = [d.get("hash"), d.get("parent") or None, d.get("profile_id")]
            ints = [int(d[f]) for f in _BLOCK_INT_FIELDS]
            if d.get("hash") != h:
                raise ValueError("the row names another hash")
            row = block_row_from([*vals[:2], vals[2], ints[0], ints[1], d.get("payload_sha256"), ints[2], ints[3],
                                  *ints[4:]])
        except (KeyError, ValueError, UnicodeDecodeError, AttributeError) as exc:
            raise IntegrityError(f"the Redis row of block {h[:12]} is damaged ({exc}); run `kvmemory fsck`") from exc
        sigs = {k[4:]: v for k, v in d.items() if k.startswith("sig.")}
        return row, sigs

    def _visible(self, row: BlockRow, sigs: dict[str, str]) -> bool:
        if self.namespace is not None:
            sig = sigs.get(self.namespace)
            if sig is None:
                return False
            return self.signer is None or self.signer.block_valid(row, self.namespace, sig)
        if self.signer is None:
            return True
        return any(self.signer.can_sign(ns) and self.signer.block_valid(row, ns, sig) for ns, sig in sigs.items())

    def _row_from_raw(self, h: str, raw: dict) -> BlockRow | None:
        if not raw:
            return None
        try:
            row, sigs = self.parse_block_row(h, raw)
        except IntegrityError as exc:
            # A damaged row is a block that is not there: the graft stops before it and recomputes.
            log.warning("%s", exc)
            return None
        if not self._visible(row, sigs):
            return None  # unsigned, forged, or another tenant's: not there for this reader
        self._vouch(row)
        return row

    def get_block(self, h: str) -> BlockRow | None:
        got = self._read(lambda: self._raw_rows([h]), "reading a block row")
        if got is None:
            return self._tier.get_block(h)
        return self._row_from_raw(h, got[0][0])

    def known_blocks(self, hashes: Sequence[str]) -> dict[str, BlockRow]:
        """Rows of the given hashes that exist, are visible to this reader and are not quarantined."""
        hashes = list(hashes)

        got = self._read(lambda: self._raw_rows(hashes), "reading block rows") if hashes else ([],)
        out = {}
        if got is None:
            for h in hashes:
                r = self._tier.get_block(h)
                if r is not None and not r.quarantined:
                    out[h] = r
            return out
        for h, raw in zip(hashes, got[0]):
            r = self._row_from_raw(h, raw)
            if r is not None and not r.quarantined:
                out[h] = r
        return out

    def _raw_rows(self, hashes: Sequence[str]) -> list[dict]:
        """Rows as raw hashes; a key that is not a hash (damage) comes back as {"\x00damaged": why}."""
        return self._hgetall_many([self.k_block(h) for h in hashes])

    def _hgetall_many(self, keys: Sequence[str]) -> list[dict]:
        p = self._r.pipeline(transaction=False)
        for k in keys:
            p.hgetall(k)
        out = p.execute(raise_on_error=False)  # connection errors still raise; WRONGTYPE comes back per key
        return [{b"\x00damaged": str(x).encode()} if isinstance(x, Exception) else x for x in out]

    # ------------------------------------------------------------------ block payloads
    def write_block_file(self, meta: BlockMeta, payload: torch.Tensor) -> int:
        """Write one block's file bytes to Redis (no catalogue change). Returns the file size."""
        header = encode_header(meta)
        data = memoryview(payload.contiguous().numpy()).cast("B")
        if len(data) != meta.payload_nbytes:
            raise InvalidInput(f"block {meta.hash[:12]}: payload has {len(data)} bytes, its header says "
                               f"{meta.payload_nbytes}")
        blob = b"".join((header, data))
        self._write(lambda: self._r.set(self.k_payload(meta.hash), blob), f"writing block {meta.hash[:12]}")
        return len(blob)

    def write_block_files(self, blocks: Sequence[tuple[BlockMeta, torch.Tensor]]) -> dict[str, int]:
        """Write block files to Redis in one round trip (no catalogue change); {hash: file size}.
        A payload already there with the same size is kept (content addressing; reads verify it)."""
        if not blocks:
            return {}
        heads = [encode_header(m) for m, _ in blocks]

        def probe():
            p = self._r.pipeline(transaction=False)
            for m, _ in blocks:
                p.strlen(self.k_payload(m.hash))
            return p.execute(raise_on_error=False)

        have = self._write(probe, "checking block payloads")
        sizes, todo = {}, []
        for (m, payload), head, n in zip(blocks, heads, have):
            size = len(head) + m.payload_nbytes
            sizes[m.hash] = size
            if n != size:
                data = memoryview(payload.contiguous().numpy()).cast("B")
                if len(data) != m.payload_nbytes:
                    raise InvalidInput(f"block {m.hash[:12]}: payload has {len(data)} bytes, its header says "
                                       f"{m.payload_nbytes}")
                todo.append((m.hash, b"".join((head, data))))

        def put():
            p = self._r.pipeline(transaction=False)
            for h, blob in todo:
                p.set(self.k_payload(h), blob)
            p.execute()

        if todo:
            self._write(put, f"writing {len(todo)} blocks")
        return sizes

    def _ensure_payloads(self, blocks: Sequence[tuple[BlockMeta, torch.Tensor]]) -> dict[str, int]:
        """Write the payloads Redis lacks (or holds for a quarantined or different row); sizes by hash."""
        if not blocks:
            return {}

        def probe():
            p = self._r.pipeline(transaction=False)
            for m, _ in blocks:
                p.hmget(self.k_block(m.hash), "payload_sha256", "quarantined", "file_nbytes")
                p.exists(self.k_payload(m.hash))
            return p.execute()

        got = self._write(probe, "checking block payloads")
        sizes = {}
        for i, (m, payload) in enumerate(blocks):
            (sha, quar, fbytes), exists = got[2 * i], got[2 * i + 1]
            if exists and sha is not None and sha.decode() == m.payload_sha256 and quar == b"0" and fbytes:
                sizes[m.hash] = int(fbytes)
            else:
                sizes[m.hash] = self.write_block_file(m, payload)
        return sizes

    def read_block(self, row: BlockRow, into: memoryview | None = None) -> tuple[BlockMeta, memoryview]:
        """A block's payload, verified against `row` before it is returned (see LocalStore.read_block).

        The local tier is tried first; a tier copy that fails verification is dropped and the block is
        fetched from Redis. A Redis copy that fails quarantines the block for everyone and raises.
        """
        if self._tier.block_path(row.hash).exists():
            try:
                return self._tier.read_block(row, into)
            except IntegrityError:
                pass  # the tier moved its bad copy aside; fetch the shared one
        try:
            got = self._read(lambda: self._r.get(self.k_payload(row.hash)), f"reading block {row.hash[:12]}")
        except IntegrityError as exc:  # the payload key holds something that is not a string
            self.quarantine(row.hash, str(exc))
            raise IntegrityError(f"block {row.hash[:12]}: {exc}") from None
        if got is None:
            raise IntegrityError(f"block {row.hash[:12]} is not in the local tier and Redis at {self.url} is "
                                 "unreachable; it is recomputed")
        data = got[0]
        try:
            if data is None:
                raise IntegrityError("its payload is missing from Redis")
            meta, off = parse_header(data)
            if data[:off] != encode_header(meta):
                raise IntegrityError("block header is not in canonical form (damaged)")
            check_meta(meta, row)
            if len(data) - off != row.payload_nbytes:
                raise IntegrityError(f"payload has {len(data) - off} bytes, the catalogue says {row.payload_nbytes}")
            buf = into if into is not None else memoryview(bytearray(row.payload_nbytes))
            if len(buf) != row.payload_nbytes:
                raise ValueError("destination buffer has the wrong size")
            buf[:] = memoryview(data)[off:]
            # Hashed where it lies: the verified bytes are the bytes that are used.
            if hashlib.sha256(buf).hexdigest() != row.payload_sha256:
                raise IntegrityError("payload SHA-256 does not match the catalogue")
        except IntegrityError as exc:
            self.quarantine(row.hash, str(exc))
            raise IntegrityError(f"block {row.hash[:12]}: {exc}") from None
        if self._vouched_for(row):
            tensor = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if row.payload_nbytes else \
                torch.empty(0, dtype=torch.uint8)
            self._tier_safe(lambda: self._tier.put_blocks([(meta, tensor)], verified=row.verified,
                                                          pinned=row.pinned))
        return meta, buf

    def touch_blocks(self, hashes: Sequence[str]) -> None:
        if self.readonly or not hashes or not self._online():
            return
        now = time.time()

        def touch():
            p = self._r.pipeline(transaction=False)
            for h in hashes:
                p.zadd(self.k_blocks(), {h: now}, xx=True)
            p.execute()

        try:
            self._write(touch, "LRU bookkeeping")
        except StoreError:
            pass  # LRU bookkeeping must never fail a read
        self._tier.touch_blocks(hashes)

    def quarantine(self, h: str, reason: str) -> None:
        """Set a damaged block aside for everyone (payload renamed, row marked); read-only: mark nothing."""
        drops.dropped([h], "quarantined")  # copies held in memory (engine/tier.py) go too
        self._tier_safe(lambda: self._tier.quarantine(h, reason) if self._tier.get_block(h) else None)
        if self.readonly or not self._online():
            return
        line = json.dumps({"hash": h, "reason": reason, "at": time.time()})

        def q():
            try:
                self._r.rename(self.k_payload(h), self.k_qpayload(h))
            except self._resp_err:
                pass  # no payload to move (missing, or already moved by another reader)
            self._scripts["quarantine"](keys=[self.k_block(h), self.k_qlog()], args=[line])

        try:
            self._write(q, f"quarantining block {h[:12]}")
        except StoreError as exc:
            log.warning("could not quarantine block %s in Redis: %s", h[:12], exc)

    # ------------------------------------------------------------------ writing rows
    def _block_args(self, m: BlockMeta, size: int, verified: bool, pinned: bool, ns: str) -> list:
        if self.signer is not None:
            sigf, sigv = f"sig.{ns}", self.signer.sign_block(m, ns)
        else:
            sigf, sigv = f"sig.{ns}", "-"  # unsigned mode: an ownership mark, so scoping still works
        return [m.hash, m.parent or "", m.profile_id, m.index, m.n_tokens, m.payload_sha256, m.payload_nbytes,
                size, int(verified), int(pinned), sigf, sigv]

    def _write_ns(self) -> str:
        return self.namespace or "default"

    def put_blocks(self, blocks: Sequence[tuple[BlockMeta, torch.Tensor]], *, verified: bool = False,
                   pinned: bool = False) -> int:
        """Store loose blocks (not part of an entry), signed for this store's namespace. Returns bytes."""
        if not blocks:
            return 0
        sizes = self._ensure_payloads(blocks)
        ns = self._write_ns()
        args: list = [repr(time.time())]
        for m, _ in blocks:
            args += self._block_args(m, sizes[m.hash], verified, pinned, ns)
        keys = [self.k_blocks()] + [self.k_block(m.hash) for m, _ in blocks]
        self._write(lambda: self._scripts["put"](keys=keys, args=args), "storing blocks")
        return sum(sizes.values())

    def _entry_fields(self, e: EntryRecord, chain_sha: Sequence[str], sig: str) -> list:
        f = {
            "id": e.id, "namespace": e.namespace, "problem": e.problem, "solution": e.solution,
            "answer": json.dumps(e.answer), "verifier": json.dumps(e.verifier, sort_keys=True),
            "verified": int(e.verified), "token_ids": np.asarray(e.token_ids, dtype="<u4").tobytes(),
            "profile_id": e.profile_id, "attestation": json.dumps(e.attestation, sort_keys=True),
            "meta": json.dumps(e.meta, sort_keys=True), "created": repr(float(e.created)),
            "updated": repr(float(e.updated)), "chain": ",".join(e.chain), "chain_sha": ",".join(chain_sha),
            "sig": sig,
        }
        return [x for kv in f.items() for x in kv]

    def has_record(self, entry_id: str) -> bool:
        """Whether the entry has a record (see LocalStore.has_record); False while Redis is away."""
        got = self._read(lambda: self._r.exists(self.k_record(entry_id)), "reading a record")
        return bool(got and got[0])

    def set_aside_entries(self) -> list[dict]:
        """Entries `fsck --repair` set aside (see LocalStore.set_aside_entries): their `qe:` keys."""
        def scan():
            out = []
            for k in self._r.scan_iter(match=self.k_qentry("*"), count=1000):
                eid = k.decode("utf-8", "replace")[len(self.k_qentry("")):]
                if self._r.zscore(self.k_entries(), eid) is not None:
                    continue
                f = self._r.hmget(k, "namespace", "problem", "fsck_reason")
                dec = [x.decode("utf-8", "replace") if isinstance(x, bytes) else None for x in f]
                out.append({"id": eid, "namespace": dec[0], "problem": dec[1], "reason": dec[2] or "set aside"})
            return out

        try:
            got = self._read(scan, "listing set-aside entries")
        except IntegrityError:
            return []
        return got[0] if got else []

    def record_of(self, entry: EntryRecord, chain_sha: Sequence[str], sig: str) -> bytes:
        """The entry's record (store/records.py), kept in Redis beside the entry and written with it."""
        from kvmemory.store.records import make_record, record_bytes

        return record_bytes(make_record(entry, signature={"namespace": entry.namespace, "sig": sig,
                                                          "chain_sha256": list(chain_sha)}))

    def _check_scope(self, entry: EntryRecord) -> None:
        if self.namespace is not None and entry.namespace != self.namespace:
            raise InvalidInput(f"this store is scoped to namespace {self.namespace!r}; "
                               f"entry {entry.id} belongs to {entry.namespace!r}")

    def commit_entry(self, entry: EntryRecord, blocks: Sequence[tuple[BlockMeta, torch.Tensor]]) -> None:
        """Write the entry's missing payloads, then entry + chain + block rows in one atomic script."""
        self._check_scope(entry)
        if self.readonly:
            raise StoreReadOnly(f"this Redis store ({self.url}, store {self.name!r}) was opened read-only")
        sizes = self._ensure_payloads(blocks)
        given = {m.hash: m.payload_sha256 for m, _ in blocks}
        missing = [h for h in entry.chain if h not in given]
        if missing:
            rows = self._write(lambda: self._raw_rows(missing), "reading chain rows")
            for h, raw in zip(missing, rows):
                if not raw:
                    raise StoreError(f"entry {entry.id}: chain block {h[:12]} is neither given nor stored")
                given[h] = self.parse_block_row(h, raw)[0].payload_sha256
        chain_sha = [given[h] for h in entry.chain]
        sig = self.signer.sign_entry(entry, chain_sha) if self.signer is not None else ""
        fields = self._entry_fields(entry, chain_sha, sig)
        record = self.record_of(entry, chain_sha, sig)
        ns = entry.namespace
        block_args: list = []
        for m, _ in blocks:
            block_args += self._block_args(m, sizes[m.hash], entry.verified, False, ns)
        for _attempt in range(20):
            old = self._write(lambda: self._r.hmget(self.k_entry(entry.id), "namespace", "chain"), "reading an entry")
            expect = "-" if old[0] is None else (old[1] or b"").decode()
            old_chain = [h for h in expect.split(",") if h] if old[0] is not None else []
            keys = ([self.k_entry(entry.id), self.k_entries(), self.k_ns(ns), self.k_blocks()]
                    + [self.k_block(m.hash) for m, _ in blocks] + [self.k_block(h) for h in entry.chain]
                    + [self.k_block(h) for h in old_chain] + [self.k_record(entry.id), self.k_seq(), self.k_feed()])
            args = [repr(time.time()), entry.id, ns, repr(float(entry.created)), expect, len(blocks),
                    len(entry.chain), len(old_chain), len(fields) // 2, *fields, *block_args, record]
            res = self._write(lambda: self._scripts["commit"](keys=keys, args=args), f"committing entry {entry.id}")
            res = res.decode() if isinstance(res, bytes) else res
            if res == "ok":
                self._tier_safe(lambda: self._tier.commit_entry(entry, []))
                return
            if res == "nsconflict":
                raise StoreError(f"entry id {entry.id} already exists in another namespace; ids are per namespace")
        raise StoreError(f"entry {entry.id} kept changing under concurrent writers; try again")

    # ------------------------------------------------------------------ reading entries
    def parse_entry(self, eid: str, raw: dict) -> tuple[EntryRecord, list[str], str]:
        """A type-checked EntryRecord, its chain payload SHA-256s and its signature, from Redis fields."""
        try:
            d = dict(raw)
            g = lambda k: d[k.encode()]  # noqa: E731
            answer = json.loads(g("answer"))
            chain = [h for h in _s(g("chain")).split(",") if h]
            chain_sha = [h for h in _s(g("chain_sha")).split(",") if h]
            row = (_s(g("id")), _s(g("namespace")), _s(g("problem")), _s(g("solution")), answer,
                   _s(g("verifier")), int(g("verified")), bytes(g("token_ids")), _s(g("profile_id")),
                   _s(g("attestation")), _s(g("meta")), float(g("created")), float(g("updated")))
            if row[0] != eid:
                raise ValueError("the entry names another id")
            if len(chain_sha) != len(chain) or not all(_HEX64.fullmatch(x) for x in chain_sha):
                raise ValueError("chain payload hashes do not match the chain")
            sig = _s(d.get(b"sig", b"")) or ""
        except (KeyError, ValueError, UnicodeDecodeError, AttributeError, TypeError) as exc:
            raise IntegrityError(f"the Redis entry {eid!r} is damaged ({exc}); run `kvmemory fsck`") from exc
        entry = entry_from_fields(row, chain)
        return entry, chain_sha, sig

    def check_entry(self, entry: EntryRecord, chain_sha: Sequence[str], sig: str) -> EntryRecord:
        if self.signer is not None:
            self.signer.verify_entry(entry, chain_sha, sig)
        return entry

    def get_entry(self, entry_id: str, namespace: str | None = None) -> EntryRecord:
        if self.namespace is not None:
            if namespace is not None and namespace != self.namespace:
                raise UnknownEntry(f"no entry {entry_id!r} in namespace {namespace!r}")
            namespace = self.namespace
        got = self._read(lambda: self._r.hgetall(self.k_entry(entry_id)), f"reading entry {entry_id}")
        if got is None:
            return self._tier.get_entry(entry_id, namespace)
        if not got[0]:
            self._tier_safe(lambda: self._tier.delete_entries([entry_id]))
            where = f" in namespace {namespace!r}" if namespace is not None else ""
            raise UnknownEntry(f"no entry {entry_id!r}{where}; `kvmemory list` (`KVMemory.list`) lists entries")
        entry, chain_sha, sig = self.parse_entry(entry_id, got[0])
        if namespace is not None and entry.namespace != namespace:
            raise UnknownEntry(f"no entry {entry_id!r} in namespace {namespace!r}")
        self.check_entry(entry, chain_sha, sig)
        self._cache_entry(entry)
        return entry

    def _cache_entry(self, entry: EntryRecord) -> None:
        def put():
            try:
                cur = self._tier.get_entry(entry.id)
                if cur == entry:
                    return
            except (UnknownEntry, IntegrityError):
                pass
            self._tier.commit_entry(entry, [])

        self._tier_safe(put)

    def _ids(self, namespace: str | None) -> list[str]:
        key = self.k_ns(namespace) if namespace is not None else self.k_entries()
        got = self._read(lambda: self._r.zrange(key, 0, -1), "listing entries")
        if got is None:
            return None
        return [x.decode() for x in got[0]]

    def list_entries(self, namespace: str | None = None) -> list[EntryRecord]:
        """Entries (oldest first). Unsigned, forged or unreadable ones are left out and their ids put in
        `rejected` (one bad row must not deny everyone the rest); `get_entry` raises on them."""
        if self.namespace is not None:
            if namespace is not None and namespace != self.namespace:
                return []
            namespace = self.namespace
        ids = self._ids(namespace)
        if ids is None:
            return self._tier.list_entries(namespace)

        got = self._read(lambda: self._hgetall_many([self.k_entry(e) for e in ids]), "reading entries") if ids \
            else ([],)
        if got is None:
            return self._tier.list_entries(namespace)
        out, rejected = [], []
        for eid, raw in zip(ids, got[0]):
            if not raw:
                continue  # deleted between the index read and the fetch
            try:
                e, chain_sha, sig = self.parse_entry(eid, raw)
                if namespace is not None and e.namespace != namespace:
                    continue
                out.append(self.check_entry(e, chain_sha, sig))
            except IntegrityError:
                rejected.append(eid)
        self.rejected = rejected
        return out

    def namespace_counts(self) -> dict[str, int]:
        """Every namespace that holds entries (this store's one, when it is scoped), with how many."""
        if self.signer is not None:  # count only what a reader may see (signed entries)
            counts: dict[str, int] = {}
            for e in self.list_entries(None):
                counts[e.namespace] = counts.get(e.namespace, 0) + 1
            return dict(sorted(counts.items()))
        ids = self._ids(self.namespace)
        if ids is None:
            return self._tier.namespace_counts()

        def fetch():
            p = self._r.pipeline(transaction=False)
            for eid in ids:
                p.hget(self.k_entry(eid), "namespace")
            return p.execute()

        got = self._read(fetch, "counting entries") if ids else ([],)
        if got is None:
            return self._tier.namespace_counts()
        counts = {}
        for ns in got[0]:
            if ns is not None:
                counts[ns.decode()] = counts.get(ns.decode(), 0) + 1
        return dict(sorted(counts.items()))

    # ------------------------------------------------------------------ the change feed (store/feed.py)
    def feed_head(self) -> FeedHead:
        """The feed's id and last sequence number: one round trip. StoreUnavailable while Redis is away."""
        def read():
            p = self._r.pipeline(transaction=False)
            p.hget(self.k_meta(), "feed_id")
            p.get(self.k_seq())
            return p.execute()

        feed_id, seq = self._fetch(read, "reading the change feed")
        try:
            return FeedHead(_s(feed_id), int(seq or 0))
        except ValueError as exc:
            raise IntegrityError(f"the change feed's counter {self.k_seq()} is damaged ({exc}); "
                                 "run `kvmemory fsck`") from exc

    def note_change(self, op: str, entry_id: str, namespace: str) -> None:
        """Record a change made outside the commit and delete scripts (fsck putting an entry back), so
        every router hears of it."""
        self._write(lambda: self._scripts["note"](keys=[self.k_seq(), self.k_feed()], args=[op, entry_id, namespace]),
                    "recording a change in the feed")

    def changes_since(self, seq: int, limit: int = 10_000) -> list[Change] | None:
        """Entries committed or deleted after `seq`, oldest first (at most `limit`); None when some were
        trimmed from the feed (the reader resyncs from the catalogue)."""
        seq = int(seq)
        rows = self._fetch(lambda: self._r.xrange(self.k_feed(), f"{seq + 1}-0", "+", count=int(limit)),
                           "reading the change feed")
        out = []
        for rid, fields in rows:
            try:
                n = int(_s(rid).split("-")[0])
                out.append(Change(n, _s(fields[b"op"]), _s(fields[b"id"]), _s(fields[b"ns"])))
            except (KeyError, ValueError, UnicodeDecodeError) as exc:
                raise IntegrityError(f"a record of the change feed {self.k_feed()} is damaged ({exc}); "
                                     "run `kvmemory fsck`") from exc
        if not out:
            head = self.feed_head().seq
            return None if head > seq else []
        if out[0].seq != seq + 1:
            return None
        return out

    def entry_ids(self, namespace: str | None = None) -> list[str]:
        if self.signer is not None:
            return [e.id for e in self.list_entries(namespace)]
        if self.namespace is not None:
            if namespace is not None and namespace != self.namespace:
                return []
            namespace = self.namespace
        ids = self._ids(namespace)
        return self._tier.entry_ids(namespace) if ids is None else ids

    def update_attestation(self, entry_id: str, attestation: dict, verified: bool) -> None:
        """Replace an entry's attestation (re-signed in the same atomic script)."""
        import dataclasses

        for _attempt in range(20):
            raw = self._write(lambda: self._r.hgetall(self.k_entry(entry_id)), f"reading entry {entry_id}")
            if not raw:
                raise UnknownEntry(f"no entry {entry_id!r}")
            entry, chain_sha, old_sig = self.parse_entry(entry_id, raw)
            self.check_entry(entry, chain_sha, old_sig)
            self._check_scope(entry)
            att = json.loads(json.dumps(attestation, sort_keys=True))
            new = dataclasses.replace(entry, attestation=att, updated=time.time())
            sig = self.signer.sign_entry(new, chain_sha) if self.signer is not None else ""
            keys = [self.k_entry(entry_id), self.k_record(entry_id)] + [self.k_block(h) for h in entry.chain]
            args = [old_sig, json.dumps(att, sort_keys=True), repr(new.updated), sig, int(verified),
                    self.record_of(new, chain_sha, sig)]
            res = self._write(lambda: self._scripts["attest"](keys=keys, args=args), "updating an attestation")
            res = res.decode() if isinstance(res, bytes) else res
            if res == "ok":
                self._tier_safe(lambda: self._tier.commit_entry(new, []))
                return
            if res == "gone":
                raise UnknownEntry(f"no entry {entry_id!r}")
        raise StoreError(f"entry {entry_id} kept changing under concurrent writers; try again")

    def delete_entries(self, entry_ids: Sequence[str]) -> int:
        """Remove entries, and the blocks they alone referenced (pinned blocks stay). Returns blocks removed.

        Unlike the local store, loose blocks that no entry ever referenced are left to `evict`.
        """
        ids = list(dict.fromkeys(entry_ids))
        if not ids:
            return 0
        for _attempt in range(20):
            def read():
                p = self._r.pipeline(transaction=False)
                for eid in ids:
                    p.hmget(self.k_entry(eid), "namespace", "chain")
                return p.execute()

            rows = self._write(read, "reading entries")
            keys = [self.k_entries(), self.k_blocks(), self.k_damaged()]
            args: list = [len(ids)]
            dec: dict[str, int] = {}
            for eid, (ns, chain) in zip(ids, rows):
                ns_s = ns.decode() if ns is not None else "\x00absent"
                if ns is not None and self.namespace is not None and ns_s != self.namespace:
                    raise UnknownEntry(f"no entry {eid!r} in namespace {self.namespace!r}")
                keys += [self.k_entry(eid), self.k_ns(ns_s), self.k_record(eid)]
                expect = "-" if ns is None else (chain or b"").decode()
                args += [eid, expect, ns_s]
                if ns is not None:
                    for h in expect.split(","):
                        if h:
                            dec[h] = dec.get(h, 0) + 1
            for h, n in dec.items():
                keys.append(self.k_block(h))
                args += [h, n]
            keys += [self.k_seq(), self.k_feed()]
            res = self._write(lambda: self._scripts["delete"](keys=keys, args=args), "deleting entries")
            res = [x.decode() if isinstance(x, bytes) else x for x in res]
            if res and res[0] == "ok":
                gone = res[1:]
                self._delete_payloads(gone)
                self._tier_safe(lambda: self._tier.delete_entries(ids))
                return len(gone)
        raise StoreError("entries kept changing under concurrent writers; try again")

    def _delete_payloads(self, hashes: Sequence[str]) -> None:
        if not hashes:
            return
        drops.dropped(hashes, "deleted")  # copies held in memory (engine/tier.py) go too

        def dele():
            p = self._r.pipeline(transaction=False)
            for h in hashes:
                p.delete(self.k_payload(h))
            p.execute()

        try:
            self._write(dele, "deleting payloads")
        except StoreUnavailable:
            pass  # the rows are gone: the payloads are orphans `kvmemory fsck` removes
        for h in hashes:
            self._tier_safe(lambda h=h: self._tier.block_path(h).unlink(missing_ok=True))

    # ------------------------------------------------------------------ accounting and eviction
    def all_block_hashes(self) -> list[str]:
        got = self._fetch(lambda: self._r.zrange(self.k_blocks(), 0, -1), "listing blocks")
        return [x.decode() for x in got]

    def _all_rows(self) -> list[tuple[str, dict]]:
        hashes = self.all_block_hashes()
        out = []
        for i in range(0, len(hashes), 1000):
            chunk = hashes[i : i + 1000]
            out += list(zip(chunk, self._fetch(lambda c=chunk: self._raw_rows(c), "reading block rows")))
        return out

    def stats(self) -> StoreStats:
        """Counts over the whole store (one pass over the rows: O(blocks + entries))."""
        rows = {}
        quarantined = nbytes = tokens = 0
        for h, raw in self._all_rows():
            if not raw:
                continue
            row, _ = self.parse_block_row(h, raw)
            rows[h] = row
            quarantined += row.quarantined
            nbytes += row.file_nbytes
            tokens += row.n_tokens
        ids = self._fetch(lambda: self._r.zrange(self.k_entries(), 0, -1), "listing entries")

        def fetch():
            p = self._r.pipeline(transaction=False)
            for eid in ids:
                p.hmget(self.k_entry(eid.decode()), "verified", "chain")
            return p.execute(raise_on_error=False)

        entries = verified = referenced = 0
        for got in (self._fetch(fetch, "reading entries") if ids else []):
            if isinstance(got, Exception):
                raise IntegrityError(f"a Redis entry key is damaged ({got}); run `kvmemory fsck`")
            ver, chain = got
            if ver is None:
                continue
            entries += 1
            verified += ver == b"1"
            try:
                hashes = (chain or b"").decode().split(",")
            except UnicodeDecodeError:
                raise IntegrityError("a Redis entry's chain field is damaged (not text); run `kvmemory fsck`") from None
            referenced += sum(rows[h].n_tokens for h in hashes if h in rows)
        return StoreStats(entries, verified, len(rows), quarantined, nbytes, tokens, referenced)

    def evict(self, max_bytes: int) -> int:
        """Delete least-recently-used blocks that are neither pinned nor verified until the store holds at
        most `max_bytes` of blocks. Entries that referenced them simply graft less."""
        rows = self._all_rows()  # in LRU order (the blocks zset is scored by last use)
        total = 0
        cand = []
        for h, raw in rows:
            if not raw:
                continue
            row, _ = self.parse_block_row(h, raw)
            total += row.file_nbytes
            if not row.pinned and not row.verified:
                cand.append(row)
        victims, need = [], total - max_bytes
        for row in cand:
            if need <= 0:
                break
            victims.append(row.hash)
            need -= row.file_nbytes
        if not victims:
            return 0
        keys = [self.k_blocks()] + [self.k_block(h) for h in victims]
        res = self._write(lambda: self._scripts["evict"](keys=keys, args=victims), "evicting blocks")
        gone = [res[i].decode() for i in range(0, len(res), 2)]
        freed = sum(int(res[i]) for i in range(1, len(res), 2))
        self._delete_payloads(gone)
        return freed


__all__ = ["RedisStore", "StoreUnavailable", "parse_url", "SignatureError"]
