"""The execution profile: everything that can change a logit bit, pinned and fingerprinted.

Blocks made under one profile are grafted only under the same profile. `profile_id` is the SHA-256 of
the profile's canonical JSON; `diff` names the fields that differ so a `ProfileMismatch` can say what
changed (a new torch, another thread count, other weights, another grid, a rebuilt kernel ...).

What identifies the code that computes (each a field, so a change to any of them is a new profile):

- `kernels`: per native kernel the profile runs (the few-query attention under `kvmemory_fewq`, the
  GGUF-block linears under `gguf-blocks`, the decode step's norms and RoPE under either of kvmemory's
  CPU attentions where that kernel runs: models/llama_step.py), the identity of the build that ran, from the build step's
  manifest (kernels/build.py): its sources' and headers' SHA-256, the compiler flags, the compiler and
  its version, the ISA build. Not the library file's own SHA-256, nor its path: two installs compiled
  from the same sources with the same compiler and flags compute the same bits;
- `code_sha256`: the SHA-256 of kvmemory's own Python files on the compute path (COMPUTE_PATH below),
  so an upgrade that edits the runner, the cache or a kernel's wrapper is a new profile even where the
  package version (`kvmemory_version`, from its metadata) is unchanged;
- `math_libraries`: the BLAS / LAPACK / oneDNN (MKL-DNN) / OpenMP builds torch was built with, and the
  environment variables that change their code paths (MKL_CBWR, MKL_ENABLE_INSTRUCTIONS, ...);
- `accelerator`: on a GPU, the driver and CUDA runtime versions, cuBLAS's and cuDNN's, and the device's
  compute capability; empty on the CPU.

A profile stored before one of these fields existed reads back with it empty, so it differs from every
profile made now and its blocks are refused naming the field.

What identifies the weights (`model_sha256`), one of two things, never confusable:

- a model `Engine.open` loaded from files: `files:` and the SHA-256 of {name: SHA-256} of its
  `config.json` and weights files (loading.weights_files, files_model_sha256). The files' digests are
  remembered across processes by their path, size, mtime, ctime, inode and device
  (models/file_hashes.py), so a second open reads no weight byte: an 8B model no longer costs seconds
  of hashing at every open. Sound because the in-memory weights are a function of those files and of
  fields the profile holds beside them: the dtype loaded in (`dtype`), the libraries that read and
  convert them (`transformers_version`, `torch_version`), the device (`device_type`, `device_name`),
  and what kvmemory did to them after loading (`linear_impl`, `attn_implementation`, `kernels`, and
  loading.py itself in `code_sha256`). Where the files do not determine the weights (weights missing
  from them and filled at random, a file changing while it was read), loading gives no identity and
  the weights are hashed in memory. A file changed on disk later is a new digest, so a new profile.
- any other model (built in memory from a config, or a LoadedModel handed to `Engine(...)`, whose
  weights the caller may have changed after loading): `weights_sha256`, 64 hex digits over every
  parameter and buffer in memory (name, dtype, shape, bytes; sorted names). A hash of the weights
  themselves, so always right, and slow for a big model.

Both are plain strings of one field, so profiles stored before the `files:` form read back unchanged
(`from_dict`); the two forms of one model differ, so blocks made under one are refused under the
other naming `model_sha256` (recompute, or open the model the same way).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import ctypes
import os
import platform
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from kvmemory.models import attention
from kvmemory.models import gguf_linear
from kvmemory.models import packed_linear
from kvmemory.kernels import decode_ops
from kvmemory.kernels import few_query_attention
from kvmemory.kernels import quantized_linear
from kvmemory.models.loading import linear_implementation
from kvmemory.kernels.cpu import cpu_info
from kvmemory.engine.determinism import Determinism
from kvmemory.errors import ProfileMismatch

# Keys of a model config that do not change what the model computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "_commit_hash", "name_or_path"}

# kvmemory's Python files that decide what is computed and how (relative to the package): the runner,
# its cache, the graft's placement, the attention and linear layers and the kernels' wrappers, the
# pinned torch settings, and loading (it decides where the weights live, and a float32 one-row linear's
# bits depend on its weight's alignment: loading.own_memory). Editing one (even a comment: the bytes are
# hashed, not parsed) is a new profile.
COMPUTE_PATH = (
    "engine/runner.py", "engine/cache.py", "engine/graft.py", "engine/determinism.py",
    "models/loading.py", "models/attention.py", "models/gguf_linear.py", "models/packed_linear.py",
    "models/llama_step.py",
    "kernels/few_query_attention.py", "kernels/quantized_linear.py", "kernels/graft_op.py", "kernels/decode_ops.py",
    "engine/static_step.py", "engine/pipeline.py",
)
# Which native kernel each attention / linear implementation runs (the profile records their builds).
_KERNEL_OF_ATTENTION = {attention.FEWQ: few_query_attention.KERNEL_LIB}
_KERNEL_OF_LINEARS = {gguf_linear.NAME: quantized_linear.KERNEL_LIB, gguf_linear.NAME_Q8: quantized_linear.KERNEL_LIB}
# A build's manifest fields that decide its bits (not the file's path or its own SHA-256).
_BUILD_IDENTITY = ("variant", "isa", "sources", "source_digest", "flags", "compiler", "compiler_version")
# Environment variables that change the code paths of torch's math libraries.
_MATH_ENV = ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE", "ONEDNN_MAX_CPU_ISA",
             "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE")  # ATEN_CPU_CAPABILITY: its effect is `cpu_isa`
# Fields whose values are dicts: `diff` names the keys inside them that differ.
_NESTED = ("kernels", "math_libraries", "accelerator")


def canonical_json(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)


def sha256_hex(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(data).hexdigest()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (no dtype conversion): a view, no copy when already contiguous CPU."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter and buffer: name, dtype, shape and bytes, in sorted name order."""
    h = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()


def config_sha256(config) -> str:
    d = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return sha256_hex(canonical_json(d))


def tokenizer_sha256(tokenizer) -> str:
    """Vocabulary, merges, normalisation, special tokens and chat template."""
    parts: dict[str, object] = {"class": type(tokenizer).__name__}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        parts["tokenizer_json"] = sha256_hex(backend.to_str())
    else:
        parts["vocab"] = sha256_hex(canonical_json(sorted(tokenizer.get_vocab().items())))
    parts["special"] = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    parts["chat_template"] = getattr(tokenizer, "chat_template", None)
    return sha256_hex(canonical_json(parts))


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_info().get("model name") or platform.processor() or platform.machine()


@dataclass(slots=True, frozen=True)
class ExecutionProfile:
    """Everything the logits depend on. Two runs with equal profiles give equal logit bytes."""

    model_sha256: str
    config_sha256: str
    tokenizer_sha256: str
    model_class: str
    dtype: str
    kv_dtype: str
    attn_implementation: str
    sdpa_backend: str
    device_type: str
    device_name: str
    cpu_isa: str
    threads: int
    torch_version: str
    transformers_version: str
    kvmemory_version: str
    deterministic: str
    chunk: int
    # Added after the first stores: a stored profile without it computed with plain linears.
    linear_impl: str = "aten"
    # The code's identity (module docstring); empty in profiles stored before these fields existed.
    kernels: dict = field(default_factory=dict)
    code_sha256: str = ""
    math_libraries: dict = field(default_factory=dict)
    accelerator: dict = field(default_factory=dict)
    # How each forward step runs (engine/static_step.py): "dynamic" (growing shapes; every profile stored
    # before this field ran so), "static" (static shapes, eagerly), "cuda-graph" (static shapes replayed
    # from CUDA graphs).
    step_mode: str = "dynamic"

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def profile_id(self) -> str:
        return sha256_hex(canonical_json(self.to_dict()))

    @classmethod
    def from_dict(cls, d: dict) -> "ExecutionProfile":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def diff(self, other: "ExecutionProfile") -> dict[str, tuple[object, object]]:
        """{field: (ours, theirs)} for every field that differs; inside `kernels`, `math_libraries` and
        `accelerator`, the keys that differ ("kernels.fewq.flags"), so a message says what changed."""
        a, b = self.to_dict(), other.to_dict()
        out: dict[str, tuple[object, object]] = {}
        for k in a:
            if a[k] == b.get(k):
                continue
            if k in _NESTED and isinstance(a[k], dict) and isinstance(b.get(k), dict) and a[k] and b[k]:
                out.update(_nested_diff(k, a[k], b[k]))
            else:
                out[k] = (a[k], b.get(k))
        return out

    def require_same(self, other: "ExecutionProfile", what: str = "these blocks") -> None:
        """Raise `ProfileMismatch` naming every differing field unless the profiles are equal."""
        d = self.diff(other)
        if d:
            detail = "; ".join(f"{k}: stored {_short(v[1])} vs current {_short(v[0])}" for k, v in sorted(d.items()))
            hint = ""
            if "kv_dtype" in d:  # the fields a user picks when opening (Engine.open / --kv-dtype, --linears)
                hint = f" (or open with kv_dtype={d['kv_dtype'][1]!r}, --kv-dtype {d['kv_dtype'][1]} on the command line)"
            linears = {gguf_linear.NAME: "gguf", gguf_linear.NAME_Q8: "q8", packed_linear.NAME: "packed",
                       packed_linear.PLAIN: "plain"}  # loading.LINEARS
            if "linear_impl" in d and d["linear_impl"][1] in linears:
                choice = linears[d["linear_impl"][1]]
                hint += f" (or open with linears={choice!r}, --linears {choice} on the command line)"
            raise ProfileMismatch(
                f"{what} were made under another execution profile ({detail}). They cannot be grafted "
                f"exactly here: recompute (or re-remember) under the current profile{hint}.",
                fields=d,
            )


def _short(value: object, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + " ...}"


def _nested_diff(prefix: str, a: dict, b: dict) -> dict[str, tuple[object, object]]:
    out: dict[str, tuple[object, object]] = {}
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if x == y:
            continue
        if isinstance(x, dict) and isinstance(y, dict):
            out.update(_nested_diff(f"{prefix}.{k}", x, y))
        else:
            out[f"{prefix}.{k}"] = (x, y)
    return out


def kernel_identities(attn_implementation: str, linear_impl: str) -> dict:
    """{kernel: its build's identity} for the native kernels these implementations run (none for
    SDPA or torch's / oneDNN's linears)."""
    out = {}
    for lib in (_KERNEL_OF_ATTENTION.get(attn_implementation), _KERNEL_OF_LINEARS.get(linear_impl)):
        if lib is None:
            continue
        info = lib.build_info()
        if info is None:  # cannot happen once the model loaded with it; say so rather than record nothing
            raise ProfileMismatch(f"the {lib.kernel} kernel the model was loaded with does not run here: "
                                  f"{lib.why_unavailable()}")
        out[lib.kernel] = {k: info.get(k) for k in _BUILD_IDENTITY}
    if linear_impl == gguf_linear.NAME_Q8 and few_query_attention.KERNEL in out:
        # the q8 profile's scores (models/attention.py) by VDPBF16PS, or widened where the CPU lacks it
        out[few_query_attention.KERNEL]["bf16_dot"] = few_query_attention.bf16_dot()
    # The lean llama step (under kvmemory's attentions) runs this kernel where it loads, else torch's
    # ops (the same bits, by test): recorded where it runs, like the others.
    info = decode_ops.build_info() if attn_implementation in (attention.NAME, attention.FEWQ) else None
    if info is not None:
        out[decode_ops.KERNEL] = {k: info.get(k) for k in _BUILD_IDENTITY}
    return out


def code_sha256(root: Path | None = None) -> str:
    """SHA-256 over kvmemory's compute-path Python files (COMPUTE_PATH, under the package folder
    `root`, this one by default): name and bytes of each."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for rel in COMPUTE_PATH:
        h.update(f"{rel}\0".encode())
        h.update((root / rel).read_bytes())
    return h.hexdigest()


def math_libraries() -> dict:
    """torch's BLAS / LAPACK / oneDNN / OpenMP builds (from `torch.__config__.show()`) and the
    environment variables that steer them."""
    libs, settings = [], {}
    for line in torch.__config__.show().splitlines():
        line = line.strip().removeprefix("- ").strip()
        if line.startswith("Build settings:"):
            for item in line.removeprefix("Build settings:").split(","):
                key, _, value = item.strip().partition("=")
                if key in ("BLAS_INFO", "LAPACK_INFO", "COMMIT_SHA", "USE_MKLDNN", "USE_OPENMP"):
                    settings[key] = value
        elif line and not line.startswith("PyTorch built with") and not line.startswith("CPU capability"):
            libs.append(line)
    env = {k: os.environ[k] for k in _MATH_ENV if k in os.environ}
    return {"libraries": libs, "build": settings, "env": env,
            "mkldnn_enabled": bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)}


def _cuda_driver_version() -> str:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            return f"{v.value // 1000}.{v.value % 1000 // 10}"
    except (OSError, AttributeError):
        pass
    return "unknown"


def _cublas_version() -> str:
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            lib = ctypes.CDLL(name)
            lib.cublasLtGetVersion.restype = ctypes.c_size_t
            return str(lib.cublasLtGetVersion())
        except (OSError, AttributeError):
            continue
    return "unknown"


def accelerator_identity(device: torch.device) -> dict:
    """On a GPU: driver, CUDA runtime, cuBLAS, cuDNN, compute capability; {} on the CPU."""
    if device.type != "cuda":
        return {}
    major, minor = torch.cuda.get_device_capability(device)
    return {
        "compute_capability": f"{major}.{minor}",
        "driver": _cuda_driver_version(),
        "cuda_runtime": str(torch.version.cuda),
        "cublas": _cublas_version(),
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "none",
    }


def kvmemory_version() -> str:
    """The installed distribution's version, from its metadata (the one place it is written: pyproject)."""
    try:
        return importlib.metadata.version("kvmemory")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _sdpa_backend(device: torch.device) -> str:
    if device.type == "cuda":
        b = torch.backends.cuda
        return (
            f"flash={b.flash_sdp_enabled()},mem_efficient={b.mem_efficient_sdp_enabled()},"
            f"math={b.math_sdp_enabled()},cudnn={b.cudnn_sdp_enabled()}"
        )
    return "cpu-default"


def build_profile(model: torch.nn.Module, tokenizer, chunk: int, determinism: Determinism, *,
                  model_sha256: str | None = None, kv_dtype: torch.dtype | None = None,
                  step_mode: str = "dynamic") -> ExecutionProfile:
    """Fingerprint a loaded model under the settings its engine pins (called inside `determinism.applied()`).
    `model_sha256`: the weights' identity when the caller knows it (the model files': module docstring),
    else the weights in memory are hashed."""
    import transformers

    param = next(model.parameters())
    device = param.device
    cfg = model.config
    dtype = str(param.dtype).removeprefix("torch.")
    det = canonical_json(determinism.to_json())
    attn = str(getattr(cfg, "_attn_implementation", None))
    linears = linear_implementation(model)
    return ExecutionProfile(
        model_sha256=model_sha256 or weights_sha256(model),
        config_sha256=config_sha256(cfg),
        tokenizer_sha256=tokenizer_sha256(tokenizer),
        model_class=type(model).__name__,
        dtype=dtype,
        kv_dtype=str(kv_dtype).removeprefix("torch.") if kv_dtype is not None else dtype,  # the runner's cache
        attn_implementation=attn,
        sdpa_backend=_sdpa_backend(device),
        device_type=device.type,
        device_name=_device_name(device),
        cpu_isa=torch.backends.cpu.get_cpu_capability(),
        threads=determinism.threads,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        kvmemory_version=kvmemory_version(),
        deterministic=det,
        chunk=int(chunk),
        linear_impl=linears,
        kernels=kernel_identities(attn, linears),
        code_sha256=code_sha256(),
        math_libraries=math_libraries(),
        accelerator=accelerator_identity(device),
        step_mode=step_mode,
    )
