"""The execution profile: everything that can change a logit bit, pinned and fingerprinted.

Blocks made under one profile are grafted only under the same profile. `profile_id` is the SHA-256 of
the profile's canonical JSON; `diff` names the fields that differ so a `ProfileMismatch` can say what
changed (a new torch, another thread count, other weights, another grid ...).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
from dataclasses import asdict, dataclass, fields

import torch

from kvmemory.models import gguf_linear
from kvmemory.models import packed_linear
from kvmemory.models.loading import linear_implementation
from kvmemory.kernels.cpu import cpu_info
from kvmemory.engine.determinism import Determinism
from kvmemory.errors import ProfileMismatch

# Keys of a model config that do not change what the model computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "_commit_hash", "name_or_path"}


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
        a, b = self.to_dict(), other.to_dict()
        return {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}

    def require_same(self, other: "ExecutionProfile", what: str = "these blocks") -> None:
        """Raise `ProfileMismatch` naming every differing field unless the profiles are equal."""
        d = self.diff(other)
        if d:
            detail = "; ".join(f"{k}: stored {v[1]!r} vs current {v[0]!r}" for k, v in sorted(d.items()))
            hint = ""
            if "kv_dtype" in d:  # the fields a user picks when opening (Engine.open / --kv-dtype, --linears)
                hint = f" (or open with kv_dtype={d['kv_dtype'][1]!r}, --kv-dtype {d['kv_dtype'][1]} on the command line)"
            linears = {gguf_linear.NAME: "gguf", packed_linear.NAME: "packed", packed_linear.PLAIN: "plain"}  # loading.LINEARS
            if "linear_impl" in d and d["linear_impl"][1] in linears:
                choice = linears[d["linear_impl"][1]]
                hint += f" (or open with linears={choice!r}, --linears {choice} on the command line)"
            raise ProfileMismatch(
                f"{what} were made under another execution profile ({detail}). They cannot be grafted "
                f"exactly here: recompute (or re-remember) under the current profile{hint}.",
                fields=d,
            )


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
                  model_sha256: str | None = None, kv_dtype: torch.dtype | None = None) -> ExecutionProfile:
    """Fingerprint a loaded model under the settings its engine pins (called inside `determinism.applied()`)."""
    import transformers

    param = next(model.parameters())
    device = param.device
    cfg = model.config
    dtype = str(param.dtype).removeprefix("torch.")
    det = canonical_json(determinism.to_json())
    return ExecutionProfile(
        model_sha256=model_sha256 or weights_sha256(model),
        config_sha256=config_sha256(cfg),
        tokenizer_sha256=tokenizer_sha256(tokenizer),
        model_class=type(model).__name__,
        dtype=dtype,
        kv_dtype=str(kv_dtype).removeprefix("torch.") if kv_dtype is not None else dtype,  # the runner's cache
        attn_implementation=str(getattr(cfg, "_attn_implementation", None)),
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
        linear_impl=linear_implementation(model),
    )
