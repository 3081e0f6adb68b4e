"""A user's own GGUF file: found from what `--model` names, and checked before anything loads.

`--model` (and `Engine.open`, `KVMemory(model=...)`, `kvmemory serve`, the framework classes) takes:
- a `.gguf` file;
- split files as llama.cpp's gguf-split writes them (`NAME-00001-of-00003.gguf`): any part names the set,
  every part must be there;
- a folder holding one GGUF model (one file, or one split set) and no `config.json`.

`inspect` reads the headers only (the tensors stay on disk, memory-mapped) and refuses, naming it, an
architecture kvmemory does not compute (ARCHITECTURES: the ones its tests cover) or a tensor of a block
type the GGUF-block kernel lacks (IQ*, TQ*, ...: models/gguf_blocks.py lists those it has), before a
single weight is read. The model's identity is the SHA-256 of its file(s) (file_hashes.py caches it).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvmemory.errors import UnknownModel, UnsupportedModel
from kvmemory.models import gguf_blocks

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True, slots=True)
class GGUFFile:
    """One GGUF model on disk: its file, or its split files in order."""

    parts: tuple[Path, ...]

    @property
    def path(self) -> Path:
        return self.parts[0]

    @property
    def name(self) -> str:
        return self.parts[0].name

    @property
    def size(self) -> int:
        return sum(p.stat().st_size for p in self.parts)


@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor of a GGUF file: where its bytes are (`data` maps them, read only when used)."""

    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is a row's length (the input features of a linear)
    type: str  # block type name (gguf-py's GGMLQuantizationType names)
    part: int
    path: Path
    offset: int  # of its bytes in the file
    nbytes: int

    def data(self) -> np.ndarray:
        """The bytes as gguf-py's reader shapes them: [rows, row bytes] uint8 for block types (and BF16),
        [rows, dims[0]] float32 / float16 for F32 / F16; memory-mapped, read-only."""
        rows = int(np.prod(self.dims[1:])) if len(self.dims) > 1 else 1
        mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.offset, shape=(self.nbytes,))
        if self.type in ("F32", "F16"):
            arr = mm.view(np.float32 if self.type == "F32" else np.float16).reshape(rows, self.dims[0])
        else:
            arr = mm.reshape(rows, self.nbytes // rows)
        return arr if len(self.dims) > 1 else arr[0]


@dataclass(frozen=True, slots=True)
class GGUFInfo:
    """What the headers say: the architecture, the scalar metadata, and every tensor."""

    architecture: str
    metadata: dict
    tensors: dict[str, Tensor]


def _split_set(path: Path) -> tuple[Path, ...]:
    """The split set `path` belongs to, in order (a lone file: itself). UnknownModel naming a missing part."""
    m = _SPLIT.match(path.name)
    if m is None:
        return (path,)
    count = int(m["count"])
    parts = tuple(path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1))
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise UnknownModel(f"{path.name} is part of a GGUF split into {count} files; missing: {', '.join(missing)}")
    return parts


def find(name: object) -> GGUFFile | None:
    """The GGUF model `name` names (a .gguf file, a part of a split set, or a folder holding one GGUF
    model and no config.json), or None when it names none. UnknownModel for a folder of several."""
    if not isinstance(name, str) or name.startswith("embedded"):
        return None
    path = Path(name).expanduser()
    if path.is_file():
        return GGUFFile(_split_set(path.resolve())) if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    sets = {_split_set(p.resolve()) for p in sorted(path.glob("*.gguf")) if p.is_file()}
    if not sets:
        return None
    if len(sets) > 1:
        names = ", ".join(sorted(s[0].name for s in sets))
        raise UnknownModel(f"{path} holds several GGUF models ({names}): give the file to use as --model")
    return GGUFFile(sets.pop())


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_HEADER = 1 << 31  # a header past 2 GB is not a model's


class _Header:
    """A GGUF header read straight from the file (scalars kept, arrays skipped): gguf-py's reader
    parses every token of the vocabulary into numpy views, seconds per load for a 150k-token model."""

    def __init__(self, path: Path):
        self.f = open(path, "rb")

    def take(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise ValueError("the file ends inside its header")
        return b

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > _MAX_HEADER:
            raise ValueError("a string longer than the file")
        return self.take(n).decode("utf-8", "replace")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.unpack("<I"), self.unpack("<Q")
            if itype in _SCALARS:
                self.f.seek(struct.calcsize(_SCALARS[itype]) * count, 1)
            else:
                for _ in range(count):
                    self.value(itype)
            return None  # arrays (the vocabulary) are transformers' to read
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_header(path: Path, part: int = 0) -> tuple[dict, dict[str, Tensor]]:
    """(scalar metadata, tensors) of one GGUF file; ValueError for a file that is not one."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    h = _Header(path)
    try:
        if h.take(4) != b"GGUF":
            raise ValueError("no GGUF magic at its start")
        version = h.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (kvmemory reads 2 and 3)")
        n_tensors, n_kv = h.unpack("<Q"), h.unpack("<Q")
        meta = {}
        for _ in range(n_kv):
            key = h.string()
            meta[key] = h.value(h.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = h.string()
            dims = tuple(h.unpack("<Q") for _ in range(h.unpack("<I")))
            ttype, offset = h.unpack("<I"), h.unpack("<Q")
            infos.append((name, dims, ttype, offset))
        align = int(meta.get("general.alignment") or 32)
        start = -(-h.f.tell() // align) * align
        size = path.stat().st_size
    finally:
        h.f.close()
    tensors = {}
    for name, dims, ttype, offset in infos:
        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            raise ValueError(f"tensor {name} has an unknown block type {ttype}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims)) if dims else 1
        nbytes = count // block * type_size
        if start + offset + nbytes > size:
            raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
        tensors[name] = Tensor(name, dims, qtype.name, part, path, start + offset, nbytes)
    return meta, tensors


def inspect(model: GGUFFile) -> GGUFInfo:
    """Read the headers of every part; UnsupportedModel (naming it) for an architecture or a block type
    kvmemory does not compute, or a file that is not a readable GGUF, before any weight is read."""
    meta, tensors = {}, {}
    for i, p in enumerate(model.parts):
        try:
            m, t = read_header(p, i)
        except (ValueError, OSError, struct.error) as exc:
            raise UnsupportedModel(f"{p} is not a readable GGUF file: {exc}") from exc
        if i == 0:
            meta = m
        tensors.update(t)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModel(f"{model.name} is a GGUF of the {arch!r} architecture; kvmemory computes "
                               f"{', '.join(ARCHITECTURES)}")
    bad = sorted((n, t.type) for n, t in tensors.items() if t.type not in gguf_blocks.TYPES)
    if bad:
        listed = ", ".join(f"{n} ({k})" for n, k in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise UnsupportedModel(f"{model.name} holds tensors of block types the GGUF-block kernel does not compute: "
                               f"{listed}; it computes {', '.join(gguf_blocks.TYPES)} (requantize the file to "
                               "Q4_K_M, Q5_K_M, Q6_K or Q8_0)")
    return GGUFInfo(architecture=arch, metadata=meta, tensors=tensors)
