"""Routing questions to stored entries: sentence embeddings in persistent FAISS indexes.

An entry is routed by its problem text and optional aliases (other phrasings that should reach it).
`Router.search` embeds the question, looks in the index of the caller's namespace only, keeps one hit
per entry (the best of its problem/aliases), and drops hits whose cosine similarity is below a
calibrated threshold so that an unrelated question routes to nothing.

Layout of `<store>/router/`:

    manifest.json                  format version, embedder identity, generation, namespace -> files
    ns-<sha16>-g<gen>.faiss        one FAISS index per namespace (faiss.write_index binary format)
    ns-<sha16>-g<gen>.json         its rows: vector id -> (entry id, kind, text), tombstones, next id
    .lock                          flock'd by writers (exclusive) and loaders (shared)

Namespaces have separate indexes, so a search can never see another namespace's vectors: isolation is
structural, not a post-filter that a large `k` could defeat. Writes are atomic: changed namespaces are
written under new generation-stamped names (temp file, fsync, os.replace), then the manifest is
replaced, which is the commit point; files no longer referenced are removed afterwards. A crash at any
moment leaves either the old or the new state. Nothing is pickled.

The index type follows the number of vectors in a namespace (see `index_kind_for`): exact flat inner
product while small, HNSW from `HNSW_THRESHOLD`, IVF from `IVF_THRESHOLD`. All vectors are
L2-normalised, so inner product is cosine similarity.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import faiss
import numpy as np

from kvmemory.errors import InvalidInput, RouterMismatch, StoreError, StoreFormatError, StoreReadOnly
# The embedders live in their own module; these names stay importable from here.
from kvmemory.routing.embedders import (  # noqa: F401
    CALIBRATED_THRESHOLDS,
    MINILM_THRESHOLD,
    Embedder,
    UseEmbedder,
    _offline,
    default_embedder_path,
    embedder_from_identity,
    number_threshold_for,
    resolve_embedder,
    threshold_for,
    weights_fingerprint,
)

try:  # POSIX advisory locks; without them (Windows) the router is safe within one process only
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "DEFAULT_THRESHOLD",
    "HNSW_THRESHOLD",
    "IVF_THRESHOLD",
    "FORMAT_VERSION",
    "Embedder",
    "Router",
    "RouteHit",
    "RouteRow",
    "default_embedder_path",
    "index_kind_for",
    "new_index",
]

FORMAT_VERSION = 1

# Cosine similarity below which a hit is dropped, for the default embedder (all-MiniLM-L6-v2; how it
# was calibrated is in embedders.py). Other embedders have their own (`threshold_for`).
DEFAULT_THRESHOLD = MINILM_THRESHOLD

# Vectors in a namespace from which the index switches from exact flat search to HNSW. Measured with
# `kvmemory.bench.router.measure_crossover` (384 dims, one query at a time on one thread, k=10, 300
# queries, shared 2-core CPU, HNSW M=32 / efSearch=128 as below):
#     n vectors      4k     8k     12k    16k    24k    32k    48k
#     flat p50 ms   0.129  0.302  0.659  1.196  2.193  2.805  3.702
#     HNSW p50 ms   0.270  0.602  0.680  1.103  1.330  1.226  1.267
# Flat is exact and at least as fast up to ~12k; from 16k HNSW is faster and the gap keeps widening
# (the full benchmark run recorded in bench/router.py measured the same crossover independently).
HNSW_THRESHOLD = 16_000

# From here on a namespace uses IVF instead of HNSW. HNSW insertion slows as the graph grows (measured
# on this 2-core machine with M=32, efConstruction=40: ~2,000 vectors/s at 48k, ~1,700/s at 100k,
# 60 s for 100k), so converting or rebuilding ~1M vectors as HNSW takes 10+ minutes; IVF trains k-means
# on a sample and builds 1M vectors in 28 s (see kvmemory/bench/router.py), at a recall cost that
# nprobe controls. IVF is terminal: it supports removal natively, so a namespace never converts back.
IVF_THRESHOLD = 500_000

HNSW_M = 32
HNSW_EF_CONSTRUCTION = 40
# Search widths, chosen on the hardest data (random 384-d unit vectors; real embeddings cluster and do
# better) for queries placed at cosine 0.85 from a stored vector, i.e. a rewording of a stored problem.
# Share of those whose nearest hit is their source (p50 latency):
#   HNSW, 100k vectors, efSearch 64 / 128 / 256 / 512: 90.0 % (0.97 ms) / 98.2 % (1.9) / 99.8 % (3.4) / 100 % (6.5)
#   IVF, 1M vectors, 1024 lists, nprobe 32 / 64 / 128:  92.4 % (2.9 ms) / 99.0 % (5.7) / 99.8 % (10.7)
# against 11 ms (100k) and 58 ms (1M) for exact flat search. Embedding the question costs more than any
# of these, so the middle settings buy ~99 % worst-case recall for a few milliseconds.
HNSW_EF_SEARCH = 128
IVF_NPROBE = 64
# HNSW cannot remove vectors; deleted ones are tombstoned and the graph is rebuilt once this many (or
# this fraction of the index) are dead.
COMPACT_MIN_DEAD = 256
COMPACT_DEAD_FRACTION = 0.25
# Adds at least this large show a progress bar while embedding unless told otherwise.
PROGRESS_MIN_TEXTS = 1000

IndexKind = Literal["flat", "hnsw", "ivf"]
RowKind = Literal["problem", "alias"]

_MANIFEST = "manifest.json"
_LOCKFILE = ".lock"
# What opening a file in a folder we may not write fails with (permissions, a read-only mount).
_READ_ONLY_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}


def _same_embedder(stored: dict[str, Any], current: dict[str, Any]) -> bool:
    # The name is informational (the same weights may live at another path); dim and weights decide.
    return stored.get("dim") == current.get("dim") and stored.get("weights_sha256") == current.get("weights_sha256")


# ---------------------------------------------------------------------------------------------------
# Index construction (shared with the benchmark so it measures exactly what the router builds)
# ---------------------------------------------------------------------------------------------------


def index_kind_for(n: int, *, hnsw_threshold: int = HNSW_THRESHOLD, ivf_threshold: int = IVF_THRESHOLD) -> IndexKind:
    """The index type for a namespace holding `n` vectors."""
    if n >= ivf_threshold:
        return "ivf"
    if n >= hnsw_threshold:
        return "hnsw"
    return "flat"


def ivf_nlist_for(n: int) -> int:
    # ~sqrt(n) lists (a power of two), the usual balance between list scan and centroid scan.
    return int(2 ** round(math.log2(max(16.0, math.sqrt(max(n, 1))))))


def new_index(kind: IndexKind, dim: int, train: np.ndarray | None = None, *, nlist: int | None = None,
              seed: int = 0) -> faiss.Index:
    """An empty index of `kind`; IVF is trained on `train` (a sample of the vectors it will hold) with
    `nlist` lists (default: from the sample size, see `ivf_nlist_for`)."""
    if kind == "flat":
        return faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
    if kind == "hnsw":
        h = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        h.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        h.hnsw.efSearch = HNSW_EF_SEARCH
        return faiss.IndexIDMap2(h)
    if kind == "ivf":
        if train is None or len(train) == 0:
            raise InvalidInput("an IVF index needs training vectors")
        # k-means wants ~39+ training points per list; fewer lists beat a badly trained quantizer.
        nlist = max(1, min(nlist or ivf_nlist_for(len(train)), len(train) // 39))
        # IVF keeps its own ids (add_with_ids, remove_ids) and is used without IndexIDMap2, whose
        # remove_ids assumes the inner index renumbers like a flat one, which IVF does not.
        # (faiss's Python constructor keeps a reference to the quantizer, so it outlives this scope.)
        ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
        ivf.cp.seed = seed
        ivf.train(np.ascontiguousarray(train, dtype=np.float32))
        ivf.nprobe = min(IVF_NPROBE, nlist)
        return ivf
    raise InvalidInput(f"unknown index kind {kind!r}")


def kind_of(index: faiss.Index) -> IndexKind:
    idx = faiss.downcast_index(index)
    if isinstance(idx, faiss.IndexIVF):
        return "ivf"
    if isinstance(idx, faiss.IndexIDMap2):
        inner = faiss.downcast_index(idx.index)
        if isinstance(inner, faiss.IndexHNSW):
            return "hnsw"
        if isinstance(inner, faiss.IndexFlat):
            return "flat"
    raise StoreFormatError(f"unexpected router index type {type(idx).__name__}")


def _all_vectors(index: faiss.Index) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 [n], vectors float32 [n, d]) of a flat or HNSW index (IDMap2-wrapped)."""
    idx = faiss.downcast_index(index)
    ids = faiss.vector_to_array(idx.id_map).astype(np.int64)
    inner = faiss.downcast_index(idx.index)
    vecs = inner.reconstruct_n(0, inner.ntotal) if inner.ntotal else np.zeros((0, idx.d), np.float32)
    return ids, np.ascontiguousarray(vecs, dtype=np.float32)


def _set_search_width(index: faiss.Index, fetch: int) -> None:
    kind = kind_of(index)
    if kind == "hnsw":
        faiss.downcast_index(faiss.downcast_index(index).index).hnsw.efSearch = max(HNSW_EF_SEARCH, fetch)
    elif kind == "ivf":
        ivf = faiss.downcast_index(index)
        ivf.nprobe = min(ivf.nlist, max(IVF_NPROBE, IVF_NPROBE * math.ceil(fetch / 256)))


def _search_one_thread(index: faiss.Index, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    # One question is one small search: an OpenMP team only adds fork/join and, on a busy machine,
    # scheduler waits (measured ~8 ms per query with 2 threads on a loaded 2-core box vs ~0.1 ms with
    # one). omp_set_num_threads sets the calling thread's own setting, so other threads are unaffected.
    old = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        return index.search(q, k)
    finally:
        faiss.omp_set_num_threads(old)


# ---------------------------------------------------------------------------------------------------
# Router
# ---------------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class RouteHit:
    """One routed entry: its best cosine similarity and the stored text (problem or alias) that matched."""

    entry_id: str
    score: float
    matched_text: str
    kind: str = "problem"


@dataclass(slots=True, frozen=True)
class RouteRow:
    """One routed text: the problem of an entry or one of its aliases."""

    entry_id: str
    namespace: str
    text: str
    kind: str = "problem"


@dataclass(slots=True)
class _Space:
    """One namespace: its own index, rows keyed by FAISS vector id, and tombstones (HNSW only)."""

    namespace: str
    index: faiss.Index
    rows: dict[int, tuple[str, str, str]]  # vid -> (entry_id, kind, text)
    by_entry: dict[str, list[int]]
    next_id: int = 0
    dead: set[int] | None = None
    files: tuple[str, str] | None = None  # (index file, rows file) as committed; None when dirty/new

    @property
    def stem(self) -> str:
        return "ns-" + hashlib.sha256(self.namespace.encode()).hexdigest()[:16]


def _check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not namespace or len(namespace) > 256 or "\0" in namespace:
        raise InvalidInput(f"invalid namespace {namespace!r}: a non-empty string of at most 256 characters")
    return namespace


def _check_entry_id(entry_id: str) -> str:
    if not isinstance(entry_id, str) or not entry_id or len(entry_id) > 512:
        raise InvalidInput(f"invalid entry id {entry_id!r}")
    return entry_id


def _check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str):
        texts = [texts]
    out: list[str] = []
    for t in texts:
        if not isinstance(t, str) or not t.strip():
            raise InvalidInput(f"cannot route by {t!r}: texts must be non-empty strings")
        if t not in out:  # an alias identical to the problem adds nothing
            out.append(t)
    if not out:
        raise InvalidInput("an entry needs at least one text (its problem) to be routed")
    return out


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write(path: Path, write: Any) -> None:
    """Write via `write(tmp_path)` to a temp file in the same folder, fsync it, then os.replace."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class Router:
    """Persistent, namespaced semantic index of entries (see the module docstring for the layout).

    `Router(folder, embedder)` opens the router in `folder` (normally `<store>/router/`), creating it on
    the first write. `embedder` is an `Embedder` or anything `resolve_embedder` takes (a built-in name
    such as "multilingual", a folder, a cached hub id); without one, the embedder the folder's manifest
    recorded is loaded (the default, all-MiniLM-L6-v2, for a new folder). If the folder was built by
    another embedder, `RouterMismatch` is raised unless `allow_mismatch=True`, in which case only
    `rows`, `rebuild` and `reindex` work. `threshold=None` takes the embedder's calibrated threshold
    (`threshold_for`; a warning for an uncalibrated model).
    Safe to share between threads; several processes may share a folder (writers serialise on a lock
    and each reloads what the others committed).
    """

    def __init__(self, folder: str | os.PathLike[str], embedder: Embedder | str | os.PathLike[str] | None = None,
                 *, threshold: float | None = None, hnsw_threshold: int = HNSW_THRESHOLD,
                 ivf_threshold: int = IVF_THRESHOLD, allow_mismatch: bool = False):
        self.folder = Path(folder).expanduser()
        self.embedder = resolve_embedder(embedder) if embedder is not None else self._recorded_embedder()
        self._explicit_threshold = threshold is not None
        self.threshold = float(threshold) if threshold is not None else threshold_for(self.embedder)
        self.hnsw_threshold = int(hnsw_threshold)
        self.ivf_threshold = int(ivf_threshold)
        if not 0 < self.hnsw_threshold <= self.ivf_threshold:
            raise InvalidInput("need 0 < hnsw_threshold <= ivf_threshold")
        self._allow_mismatch = allow_mismatch
        self._mismatch: str | None = None
        self._lock = threading.RLock()
        self._spaces: dict[str, _Space] = {}
        self._entry_ns: dict[str, str] = {}
        self._generation = 0
        self._stored_embedder: dict[str, Any] | None = None
        self._sig: tuple[int, int, int] | None = None
        self._removed = False  # a namespace was dropped since the last commit
        self._unsaved = False  # changes made by `apply_unsaved` not committed to the folder yet
        self.unsaved_lost = 0  # times a reload from the folder dropped such changes (apply_unsaved)
        with self._lock:
            self._refresh(force=True)

    @property
    def number_threshold(self) -> float | None:
        """The embedder's calibrated number threshold (memory/routing.py: the score from which `answer`
        routes to an entry whose problem writes the question's numbers); None when this router was
        given a threshold (that one then gates every route) or the embedder has none calibrated."""
        return None if self._explicit_threshold else number_threshold_for(self.embedder)

    def _recorded_embedder(self) -> Embedder:
        """The embedder the manifest names (so a store keeps the one it was indexed with), else the default.
        An unreadable manifest is reported by `_load`, with its own message."""
        return recorded_embedder(self.folder)

    # -- locking and loading ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _flock(self, exclusive: bool) -> Iterator[None]:
        if fcntl is None:
            yield
            return
        if not exclusive and not self.folder.is_dir():
            yield  # nothing on disk to protect; a reader must not create the folder
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.folder / _LOCKFILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if exc.errno not in _READ_ONLY_ERRNOS:
                raise
            if exclusive:
                raise StoreReadOnly(f"the router in {self.folder} is read-only ({exc.strerror}); "
                                    "open the store where it is writable to route new entries") from None
            # A reader in a folder it may not write (chmod a-w, a read-only mount): a shared lock
            # needs only read access to the lock file; without one no writer ever committed here.
            try:
                fd = os.open(self.folder / _LOCKFILE, os.O_RDONLY)
            except FileNotFoundError:
                yield
                return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    @property
    def writable(self) -> bool:
        """Whether this process may commit here (a reader of a read-only store may not): the folder,
        or the nearest existing folder above it when it is not made yet, must be writable."""
        target = self.folder
        while not target.exists() and target != target.parent:
            target = target.parent
        return os.access(target, os.W_OK)

    def _manifest_sig(self) -> tuple[int, int, int] | None:
        try:
            st = (self.folder / _MANIFEST).stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _refresh(self, *, force: bool = False, locked: bool = False) -> None:
        """Reload what another process (or a failed write of ours) changed on disk. Caller holds _lock."""
        sig = self._manifest_sig()
        if not force and sig == self._sig:
            return
        ctx = contextlib.nullcontext() if locked else self._flock(exclusive=False)
        with ctx:
            self._load(force=force)

    def _load(self, *, force: bool) -> None:
        if self._unsaved:  # what apply_unsaved changed is dropped: the caller is told by the counter
            self._unsaved = False
            self.unsaved_lost += 1
        sig = self._manifest_sig()
        if sig is None:
            self._spaces, self._entry_ns, self._generation = {}, {}, 0
            self._stored_embedder, self._sig, self._mismatch = None, None, None
            return
        try:
            manifest = json.loads((self.folder / _MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise StoreFormatError(f"{self.folder / _MANIFEST} is unreadable ({e}); run `kvmemory reindex`") from e
        if manifest.get("format") != "kvmemory-router":
            raise StoreFormatError(f"{self.folder} is not a kvmemory router folder")
        if int(manifest.get("version", 0)) > FORMAT_VERSION:
            raise StoreFormatError(
                f"router in {self.folder} has format {manifest.get('version')}, newer than this kvmemory "
                f"understands ({FORMAT_VERSION}); upgrade kvmemory")
        stored = manifest.get("embedder") or {}
        current = self.embedder.identity
        self._mismatch = None
        if stored and not _same_embedder(stored, current):
            msg = (f"router index in {self.folder} was built with embedder {stored.get('name')!r} "
                   f"(dim {stored.get('dim')}, weights {str(stored.get('weights_sha256'))[:12]}), but it was "
                   f"opened with {current['name']!r} (dim {current['dim']}, weights "
                   f"{current['weights_sha256'][:12]}); open it without embedder= to use the recorded one, or "
                   f"run `kvmemory reindex` (KVMemory.reindex(embedder=...)) to re-embed the store with "
                   f"{current.get('spec')!r}")
            if not self._allow_mismatch:
                raise RouterMismatch(msg)
            self._mismatch = msg
        spaces: dict[str, _Space] = {}
        for ns, files in manifest.get("spaces", {}).items():
            index_file, rows_file = files["index"], files["rows"]
            old = self._spaces.get(ns)
            if not force and old is not None and old.files == (index_file, rows_file):
                spaces[ns] = old  # unchanged since we last read it
                continue
            spaces[ns] = self._read_space(ns, index_file, rows_file)
        self._spaces = spaces
        self._entry_ns = {e: ns for ns, sp in spaces.items() for e in sp.by_entry}
        self._generation = int(manifest.get("generation", 0))
        self._stored_embedder = stored or None
        self._sig = sig

    def _read_space(self, ns: str, index_file: str, rows_file: str) -> _Space:
        try:
            data = json.loads((self.folder / rows_file).read_text(encoding="utf-8"))
            index = faiss.read_index(str(self.folder / index_file))
        except (OSError, ValueError, RuntimeError) as e:
            raise StoreFormatError(f"router files for namespace {ns!r} are unreadable ({e}); "
                                   "run `kvmemory reindex`") from e
        rows: dict[int, tuple[str, str, str]] = {}
        by_entry: dict[str, list[int]] = {}
        for vid, entry_id, kind, text in data["rows"]:
            rows[int(vid)] = (entry_id, kind, text)
            by_entry.setdefault(entry_id, []).append(int(vid))
        dead = set(int(v) for v in data.get("dead", []))
        expected = len(rows) + len(dead)
        if index.ntotal != expected:
            raise StoreFormatError(f"router index of namespace {ns!r} holds {index.ntotal} vectors but its rows "
                                   f"name {expected}; run `kvmemory reindex`")
        sp = _Space(ns, index, rows, by_entry, int(data["next_id"]), dead or None, (index_file, rows_file))
        if kind_of(index) == "hnsw":
            faiss.downcast_index(faiss.downcast_index(index).index).hnsw.efSearch = HNSW_EF_SEARCH
        elif kind_of(index) == "ivf":
            faiss.downcast_index(index).nprobe = min(IVF_NPROBE, faiss.downcast_index(index).nlist)
        return sp

    def _check_usable(self) -> None:
        if self._mismatch:
            raise RouterMismatch(self._mismatch)

    # -- committing ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Exclusive section: reload others' commits, let the caller mutate, commit; undo on failure."""
        with self._lock, self._flock(exclusive=True):
            self._refresh(locked=True)
            try:
                yield
                self._commit()
            except BaseException as e:
                # In-memory state may be half-mutated: go back to what is on disk.
                self._removed = False
                try:
                    self._load(force=True)
                    # Files written for the commit that did not happen are referenced by nothing.
                    if self.folder.is_dir():
                        self._collect_garbage()
                except Exception:  # noqa: BLE001 - keep the original error; retry the load next call
                    self._sig = (-1, -1, -1)
                if isinstance(e, OSError):
                    raise StoreError(f"could not write the router in {self.folder}: {e}") from e
                raise

    def _commit(self) -> None:
        dirty = [sp for sp in self._spaces.values() if sp.files is None]
        if not dirty and not self._removed:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        gen = self._generation + 1
        for sp in dirty:
            index_file, rows_file = f"{sp.stem}-g{gen}.faiss", f"{sp.stem}-g{gen}.json"
            _atomic_write(self.folder / index_file, lambda p, ix=sp.index: faiss.write_index(ix, p))
            payload = {
                "namespace": sp.namespace,
                "next_id": sp.next_id,
                "dead": sorted(sp.dead) if sp.dead else [],
                "rows": [[vid, e, k, t] for vid, (e, k, t) in sorted(sp.rows.items())],
            }
            body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
            _atomic_write(self.folder / rows_file, lambda p, b=body: Path(p).write_bytes(b))
            sp.files = (index_file, rows_file)
        identity = self.embedder.identity
        manifest = {
            "format": "kvmemory-router",
            "version": FORMAT_VERSION,
            "embedder": identity,
            "generation": gen,
            "spaces": {ns: {"index": sp.files[0], "rows": sp.files[1]} for ns, sp in sorted(self._spaces.items())},
        }
        body = json.dumps(manifest, ensure_ascii=False, indent=1).encode("utf-8")
        _atomic_write(self.folder / _MANIFEST, lambda p: Path(p).write_bytes(body))
        _fsync_dir(self.folder)
        self._generation, self._stored_embedder, self._mismatch = gen, identity, None
        self._sig = self._manifest_sig()
        self._removed = False
        self._unsaved = False
        self._collect_garbage()

    def _collect_garbage(self) -> None:
        live = {f for sp in self._spaces.values() if sp.files for f in sp.files}
        for f in self.folder.iterdir():
            if f.name.startswith("ns-") and f.name not in live or f.name.startswith(".tmp-"):
                with contextlib.suppress(OSError):
                    f.unlink()

    # -- mutation helpers (caller holds the write section) ------------------------------------------

    def _space_for(self, ns: str, dim: int) -> _Space:
        sp = self._spaces.get(ns)
        if sp is None:
            sp = _Space(ns, new_index("flat", dim), {}, {})
            self._spaces[ns] = sp
        return sp

    def _insert(self, sp: _Space, entry_id: str, texts: list[str], vecs: np.ndarray) -> None:
        vids = np.arange(sp.next_id, sp.next_id + len(texts), dtype=np.int64)
        sp.next_id += len(texts)
        for j, (vid, text) in enumerate(zip(vids.tolist(), texts)):
            sp.rows[vid] = (entry_id, "problem" if j == 0 else "alias", text)
        sp.by_entry[entry_id] = vids.tolist()
        self._entry_ns[entry_id] = sp.namespace
        self._add_vectors(sp, vids, vecs)
        sp.files = None

    def _add_vectors(self, sp: _Space, vids: np.ndarray, vecs: np.ndarray) -> None:
        kind = kind_of(sp.index)
        live_after = len(sp.rows)  # rows already include the new ones
        target = index_kind_for(live_after, hnsw_threshold=self.hnsw_threshold, ivf_threshold=self.ivf_threshold)
        order = {"flat": 0, "hnsw": 1, "ivf": 2}
        if order[target] > order[kind]:
            # Grow into the bigger index type: gather the live vectors and rebuild once.
            old_ids, old_vecs = _all_vectors(sp.index)
            if sp.dead:
                keep = ~np.isin(old_ids, np.fromiter(sp.dead, dtype=np.int64))
                old_ids, old_vecs = old_ids[keep], old_vecs[keep]
            ids = np.concatenate([old_ids, vids])
            allv = np.concatenate([old_vecs, vecs]) if len(old_vecs) else vecs
            sp.index = self._build(target, ids, allv)
            sp.dead = None
        else:
            sp.index.add_with_ids(np.ascontiguousarray(vecs, dtype=np.float32), vids)

    def _build(self, kind: IndexKind, ids: np.ndarray, vecs: np.ndarray) -> faiss.Index:
        train, nlist = None, None
        if kind == "ivf":
            # Train on a sample: k-means over all of ~1M vectors would cost minutes and buys nothing.
            rng = np.random.default_rng(0)
            nlist = ivf_nlist_for(len(vecs))
            take = min(len(vecs), 50 * nlist)
            train = vecs[np.sort(rng.choice(len(vecs), size=take, replace=False))]
        index = new_index(kind, vecs.shape[1], train, nlist=nlist)
        if len(vecs):
            index.add_with_ids(np.ascontiguousarray(vecs, dtype=np.float32), np.ascontiguousarray(ids, dtype=np.int64))
        return index

    def _remove(self, entry_id: str) -> None:
        ns = self._entry_ns.pop(entry_id)
        sp = self._spaces[ns]
        vids = sp.by_entry.pop(entry_id)
        for v in vids:
            del sp.rows[v]
        sp.files = None
        if not sp.rows:
            del self._spaces[ns]
            self._removed = True
            return
        kind = kind_of(sp.index)
        arr = np.asarray(vids, dtype=np.int64)
        if kind == "hnsw":
            # HNSW graphs cannot drop nodes: tombstone, and rebuild when tombstones pile up.
            sp.dead = (sp.dead or set()) | set(vids)
            if len(sp.dead) >= max(COMPACT_MIN_DEAD, COMPACT_DEAD_FRACTION * sp.index.ntotal):
                ids, vecs = _all_vectors(sp.index)
                keep = ~np.isin(ids, np.fromiter(sp.dead, dtype=np.int64))
                target = index_kind_for(int(keep.sum()), hnsw_threshold=self.hnsw_threshold,
                                        ivf_threshold=self.ivf_threshold)
                sp.index = self._build(target, ids[keep], vecs[keep])
                sp.dead = None
        else:
            removed = sp.index.remove_ids(faiss.IDSelectorBatch(arr))
            if removed != len(vids):
                raise StoreFormatError(f"router index of {ns!r} lost track of entry {entry_id!r}; run `kvmemory reindex`")

    # -- public API ---------------------------------------------------------------------------------

    def add(self, entry_id: str, namespace: str, texts: Sequence[str], *, progress: bool | None = None) -> None:
        """Route `entry_id` by `texts`: texts[0] is its problem, the rest are aliases. Ids are unique
        across namespaces; adding an existing one raises InvalidInput (use `update`)."""
        self.add_many([(entry_id, namespace, texts)], progress=progress)

    def add_many(self, items: Iterable[tuple[str, str, Sequence[str]]], *, progress: bool | None = None) -> int:
        """Add several entries with one embedding pass and one commit; returns how many were added."""
        return self._put(items, replace=False, progress=progress)

    def update(self, entry_id: str, namespace: str, texts: Sequence[str], *, progress: bool | None = None) -> None:
        """Replace the texts (and possibly the namespace) of `entry_id`; adds it when it is new."""
        self._put([(entry_id, namespace, texts)], replace=True, progress=progress)

    def update_many(self, items: Iterable[tuple[str, str, Sequence[str]]], *, progress: bool | None = None) -> int:
        """`update` of several entries with one embedding pass and one commit; returns how many."""
        return self._put(items, replace=True, progress=progress)

    def _put(self, items: Iterable[tuple[str, str, Sequence[str]]], *, replace: bool, progress: bool | None) -> int:
        checked: list[tuple[str, str, list[str]]] = []
        seen: set[str] = set()
        for entry_id, namespace, texts in items:
            _check_entry_id(entry_id)
            _check_namespace(namespace)
            if entry_id in seen:
                raise InvalidInput(f"entry {entry_id!r} appears twice in one add")
            seen.add(entry_id)
            checked.append((entry_id, namespace, _check_texts(texts)))
        if not checked:
            return 0
        with self._lock:
            self._refresh()
            self._check_usable()
            if not replace:
                for entry_id, _, _ in checked:
                    if entry_id in self._entry_ns:
                        raise InvalidInput(f"entry {entry_id!r} is already routed (namespace "
                                           f"{self._entry_ns[entry_id]!r}); use update to change it")
        # Embed outside the write lock: it is the slow part and touches nothing shared.
        flat_texts = [t for _, _, ts in checked for t in ts]
        show = progress if progress is not None else len(flat_texts) >= PROGRESS_MIN_TEXTS
        vecs = self.embedder.embed(flat_texts, progress=show)
        with self._writing():
            self._check_usable()
            offset = 0
            for entry_id, namespace, texts in checked:
                v = vecs[offset:offset + len(texts)]
                offset += len(texts)
                if entry_id in self._entry_ns:
                    if not replace:  # another process added it while we were embedding
                        raise InvalidInput(f"entry {entry_id!r} is already routed; use update to change it")
                    self._remove(entry_id)
                self._insert(self._space_for(namespace, vecs.shape[1]), entry_id, texts, v)
        return len(checked)

    def delete(self, entry_id: str) -> bool:
        """Stop routing to `entry_id`. Returns False when it was not routed."""
        _check_entry_id(entry_id)
        with self._writing():
            if entry_id not in self._entry_ns:
                return False
            self._remove(entry_id)
            return True

    def apply_unsaved(self, puts: Sequence[tuple[str, str, Sequence[str]]], drops: Sequence[str]) -> int:
        """`update_many(puts)` and `delete_many(drops)` in this process's memory only, without writing the
        folder: writing a namespace's index costs as much as the index is large (a second for 100,000
        vectors), too much to follow another process's change at once. The next commit of this router
        (any `add`, `update`, `delete`) writes them with its own. A reload of the folder (another
        process committed to it) drops them and counts it in `unsaved_lost`, so a caller that relies on
        them (memory/router_feed.py) resyncs. Returns how many entries changed."""
        checked = [(_check_entry_id(e), _check_namespace(ns), _check_texts(ts)) for e, ns, ts in puts]
        drops = [_check_entry_id(e) for e in drops]
        vecs = self.embedder.embed([t for _, _, ts in checked for t in ts]) if checked else None
        with self._lock:
            self._refresh()
            self._check_usable()
            n = 0
            offset = 0
            for entry_id, namespace, texts in checked:
                v = vecs[offset:offset + len(texts)]
                offset += len(texts)
                if entry_id in self._entry_ns:
                    self._remove(entry_id)
                self._insert(self._space_for(namespace, vecs.shape[1]), entry_id, texts, v)
                n += 1
            for entry_id in dict.fromkeys(drops):
                if entry_id in self._entry_ns:
                    self._remove(entry_id)
                    n += 1
            if n:
                self._unsaved = True
            return n

    def delete_many(self, entry_ids: Iterable[str]) -> int:
        """Stop routing to several entries in one commit; returns how many were routed."""
        ids = [_check_entry_id(e) for e in entry_ids]
        if not ids:
            return 0
        with self._writing():
            n = 0
            for entry_id in dict.fromkeys(ids):
                if entry_id in self._entry_ns:
                    self._remove(entry_id)
                    n += 1
            return n

    def delete_namespace(self, namespace: str) -> int:
        """Remove every entry of `namespace`; returns how many there were."""
        _check_namespace(namespace)
        with self._writing():
            sp = self._spaces.pop(namespace, None)
            if sp is None:
                return 0
            for e in sp.by_entry:
                self._entry_ns.pop(e, None)
            self._removed = True
            return len(sp.by_entry)

    def rebuild(self, rows: Iterable[RouteRow], *, progress: bool | None = None) -> int:
        """Replace everything with `rows` (embedded with the current embedder); returns entries routed.

        Rows of one entry keep their order; its "problem" row comes first. Used by `kvmemory reindex`.
        """
        grouped: dict[str, tuple[str, list[tuple[str, str]]]] = {}
        for r in rows:
            _check_entry_id(r.entry_id)
            _check_namespace(r.namespace)
            if r.kind not in ("problem", "alias"):
                raise InvalidInput(f"row kind must be 'problem' or 'alias', got {r.kind!r}")
            ns, lst = grouped.setdefault(r.entry_id, (r.namespace, []))
            if ns != r.namespace:
                raise InvalidInput(f"entry {r.entry_id!r} appears in two namespaces ({ns!r}, {r.namespace!r})")
            lst.append((r.kind, r.text))
        items = []
        for entry_id, (ns, lst) in grouped.items():
            lst.sort(key=lambda kt: kt[0] != "problem")  # stable: problem first, aliases in order
            items.append((entry_id, ns, _check_texts([t for _, t in lst])))
        texts = [t for _, _, ts in items for t in ts]
        show = progress if progress is not None else len(texts) >= PROGRESS_MIN_TEXTS
        vecs = self.embedder.embed(texts, progress=show)
        with self._writing():
            self._spaces, self._entry_ns, self._removed = {}, {}, True
            by_ns: dict[str, list[tuple[str, list[str], np.ndarray]]] = {}
            offset = 0
            for entry_id, ns, ts in items:
                by_ns.setdefault(ns, []).append((entry_id, ts, vecs[offset:offset + len(ts)]))
                offset += len(ts)
            for ns, group in by_ns.items():
                # Build each namespace's index in one go with the type its final size calls for.
                sp = _Space(ns, faiss.IndexIDMap2(faiss.IndexFlatIP(1)), {}, {})
                all_ids, all_vecs = [], []
                for entry_id, ts, v in group:
                    vids = list(range(sp.next_id, sp.next_id + len(ts)))
                    sp.next_id += len(ts)
                    for j, (vid, t) in enumerate(zip(vids, ts)):
                        sp.rows[vid] = (entry_id, "problem" if j == 0 else "alias", t)
                    sp.by_entry[entry_id] = vids
                    self._entry_ns[entry_id] = ns
                    all_ids.extend(vids)
                    all_vecs.append(v)
                kind = index_kind_for(len(all_ids), hnsw_threshold=self.hnsw_threshold, ivf_threshold=self.ivf_threshold)
                sp.index = self._build(kind, np.asarray(all_ids, dtype=np.int64), np.concatenate(all_vecs))
                self._spaces[ns] = sp
        return len(items)

    def reindex(self, *, embedder: Embedder | str | os.PathLike[str] | None = None,
                progress: bool | None = None) -> int:
        """Re-embed every stored text with `embedder` (default: the current one), the fix for
        RouterMismatch and the way to switch a store to another embedder. Atomic: the new indexes and
        the manifest naming the new embedder replace the old ones in one commit, or nothing changes.
        The threshold follows the new embedder unless one was given explicitly."""
        rows = self.rows()
        if embedder is not None:
            new = resolve_embedder(embedder)
            with self._lock:
                old = (self.embedder, self.threshold, self._allow_mismatch)
                self.embedder, self._allow_mismatch = new, True  # the folder still names the old one
                if not self._explicit_threshold:
                    self.threshold = threshold_for(new)
            try:
                return self.rebuild(rows, progress=progress)
            except BaseException:
                with self._lock:
                    self.embedder, self.threshold, self._allow_mismatch = old
                    self._sig = (-1, -1, -1)  # reload (and re-check) against the old embedder next call
                raise
        return self.rebuild(rows, progress=progress)

    def search(self, query: str, k: int = 5, namespace: str = "default", threshold: float | None = None) -> list[RouteHit]:
        """Up to `k` entries of `namespace`, best first, one hit per entry, each scoring >= threshold.

        `threshold=None` uses the router's threshold (DEFAULT_THRESHOLD unless set); pass -1.0 to
        get the nearest entries however far they are.
        """
        if not isinstance(query, str) or not query.strip():
            raise InvalidInput("cannot route an empty question")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise InvalidInput(f"k must be a positive integer, got {k!r}")
        _check_namespace(namespace)
        thr = self.threshold if threshold is None else float(threshold)
        with self._lock:
            self._refresh()
            self._check_usable()
            if namespace not in self._spaces:
                return []
        vec = self.embedder.embed([query])
        return self.search_vector(vec[0], k, namespace, thr)

    def search_vector(self, vec: np.ndarray, k: int, namespace: str, threshold: float) -> list[RouteHit]:
        """`search` for an already-embedded (normalised) query vector."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise InvalidInput(f"k must be a positive integer, got {k!r}")
        q = np.ascontiguousarray(np.asarray(vec, dtype=np.float32).reshape(1, -1))
        with self._lock:
            self._refresh()
            self._check_usable()
            sp = self._spaces.get(namespace)
            if sp is None or not sp.rows:
                return []
            if q.shape[1] != sp.index.d:
                raise RouterMismatch(f"query has {q.shape[1]} dims, the index {sp.index.d}; run `kvmemory reindex`")
            n = sp.index.ntotal
            # Over-fetch: an entry may own several vectors (aliases) and tombstones take slots too.
            fetch = min(n, max(4 * k, k + 16) + len(sp.dead or ()))
            while True:
                _set_search_width(sp.index, fetch)
                scores, ids = _search_one_thread(sp.index, q, fetch)
                best: dict[str, RouteHit] = {}
                below = False
                for s, vid in zip(scores[0].tolist(), ids[0].tolist()):
                    if vid < 0:
                        continue
                    row = sp.rows.get(vid)
                    if row is None:  # tombstone
                        continue
                    if s < threshold:
                        below = True
                        continue
                    entry_id, kind, text = row
                    if entry_id not in best or s > best[entry_id].score:
                        best[entry_id] = RouteHit(entry_id, float(s), text, kind)
                if len(best) >= k or fetch >= n or below:
                    break
                fetch = min(n, fetch * 4)
            hits = sorted(best.values(), key=lambda h: (-h.score, h.entry_id))
            return hits[:k]

    # -- inspection ---------------------------------------------------------------------------------

    def rows(self, namespace: str | None = None) -> list[RouteRow]:
        """Every routed text (of one namespace, or all), problem rows before aliases per entry."""
        with self._lock:
            self._refresh()
            out: list[RouteRow] = []
            for ns, sp in sorted(self._spaces.items()):
                if namespace is not None and ns != namespace:
                    continue
                for entry_id, vids in sp.by_entry.items():
                    for v in vids:
                        e, kind, text = sp.rows[v]
                        out.append(RouteRow(e, ns, text, kind))
            return out

    def texts(self, entry_id: str) -> list[str]:
        """The routed texts of one entry (problem first); [] when it is not routed."""
        with self._lock:
            self._refresh()
            ns = self._entry_ns.get(entry_id)
            if ns is None:
                return []
            sp = self._spaces[ns]
            return [sp.rows[v][2] for v in sp.by_entry[entry_id]]

    def namespace_of(self, entry_id: str) -> str | None:
        with self._lock:
            self._refresh()
            return self._entry_ns.get(entry_id)

    def namespaces(self) -> list[str]:
        with self._lock:
            self._refresh()
            return sorted(self._spaces)

    def count(self, namespace: str | None = None) -> int:
        """Entries routed (in one namespace, or in all)."""
        with self._lock:
            self._refresh()
            if namespace is None:
                return len(self._entry_ns)
            sp = self._spaces.get(namespace)
            return len(sp.by_entry) if sp else 0

    def __len__(self) -> int:
        return self.count()

    def __contains__(self, entry_id: object) -> bool:
        with self._lock:
            self._refresh()
            return entry_id in self._entry_ns

    def stats(self) -> dict[str, Any]:
        """Per-namespace sizes and index types, plus the recorded embedder (JSON-able)."""
        with self._lock:
            self._refresh()
            spaces = {}
            for ns, sp in sorted(self._spaces.items()):
                size = None
                if sp.files:
                    with contextlib.suppress(OSError):
                        size = (self.folder / sp.files[0]).stat().st_size
                spaces[ns] = {"entries": len(sp.by_entry), "vectors": len(sp.rows), "tombstones": len(sp.dead or ()),
                              "index": kind_of(sp.index), "index_bytes": size}
            return {"folder": str(self.folder), "format_version": FORMAT_VERSION, "generation": self._generation,
                    "embedder": self._stored_embedder, "threshold": self.threshold, "entries": len(self._entry_ns),
                    "namespaces": spaces}


def route_rows(entries: Iterable) -> list[RouteRow]:
    """What routes to each entry: its problem, and its aliases (`meta["aliases"]`)."""
    rows = []
    for e in entries:
        rows.append(RouteRow(e.id, e.namespace, e.problem, "problem"))
        aliases = e.meta.get("aliases", []) if isinstance(e.meta, dict) else []
        rows.extend(RouteRow(e.id, e.namespace, a, "alias") for a in aliases if isinstance(a, str) and a.strip())
    return rows


def set_aside_rows(store) -> list[RouteRow]:
    """Routes to the entries `fsck --repair` set aside (by their problem, in their namespace), so a question
    that would have been answered from one is refused naming it, never answered as if it never was."""
    rows = []
    listed = getattr(store, "set_aside_entries", None)
    for d in listed() if listed is not None else []:
        try:
            _check_entry_id(d["id"]), _check_namespace(d["namespace"]), _check_texts([d["problem"]])
        except (InvalidInput, KeyError, TypeError):
            continue  # a row too damaged to route by
        rows.append(RouteRow(d["id"], d["namespace"], d["problem"], "problem"))
    return rows


def serving_rows(store) -> list[RouteRow]:
    """What a router built for `store` routes: every entry it serves, and the entries set aside."""
    return route_rows(store.list_entries()) + set_aside_rows(store)


def recorded_embedder(folder: Path) -> Embedder:
    """The embedder a router folder's manifest names, else the default."""
    try:
        manifest = json.loads((Path(folder) / _MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return Embedder.default()
    stored = manifest.get("embedder") if isinstance(manifest, dict) else None
    return embedder_from_identity(stored if isinstance(stored, dict) else None)


def router_rebuilder(store, *, progress: bool = False) -> Callable[[], int]:
    """A `router_rebuild` callback for `run_fsck`: rebuilds `<store.path>/router` from the entries the
    store serves (what `KVMemory.reindex` does, without loading the language model). Returns texts routed."""

    def rebuild() -> int:
        folder = store.path / "router"
        try:
            router = Router(folder, allow_mismatch=True)
        except StoreFormatError:
            # A damaged router (truncated index, rows that do not match it, an unreadable manifest): set
            # aside whole (kept in quarantine/ for whoever wants to look) and built again from the entries,
            # with the embedder its manifest names when that is still readable.
            embedder = recorded_embedder(folder)
            aside = store.path / "quarantine" / f"router-{time.time_ns()}"
            aside.parent.mkdir(parents=True, exist_ok=True)
            os.replace(folder, aside)
            router = Router(folder, embedder, allow_mismatch=True)
        return router.rebuild(serving_rows(store), progress=progress)

    return rebuild
