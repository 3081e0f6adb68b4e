"""Which device and dtype a model runs on (`--device auto|cpu|cuda|cuda:N`, `--dtype auto|float32|bfloat16|
float16`), resolved here and nowhere else (the CLI, `kvmemory serve`, `KVMemory`, `Engine.open` and the framework
integrations all come through `resolve_device` / `resolve_dtype`).

- `auto` device: `cuda` where torch sees a CUDA device and the kvmemory_cuda_graft kernel is usable
  (kernels/graft_op.py chose `IMPL == "cuda"`), else `cpu`. The embedded SmolLM2-135M stays on the CPU
  under `auto` even then: its CPU profile (the GGUF-block linears, kvmemory's few-query attention) is the
  default the project measures and keeps, and a 135M model's GPU step is launch-bound (a graft there was
  measured slower than a plain single pass, issue 39); `--device cuda` puts it on the GPU when asked.
- An explicit `cuda` / `cuda:N` that cannot run here (a CPU build of torch, no visible device, an index
  past the last device) is a `DeviceUnavailable` naming what there is, raised before any model loads:
  an explicit request never falls back to the CPU. `cuda` is recorded as `cuda:<current device>`, so
  `cuda` and `cuda:0` open the same thing.
- `auto` dtype: on the CPU `None`, i.e. what loading did before devices existed (transformers' own
  choice: the checkpoint's dtype, float32 for the embedded model and for float32 checkpoints), so CPU
  profiles are unchanged; on a GPU bfloat16 (float16 on a GPU without bfloat16). The stock profile
  decides its own (float32: loading.stock_options).
"""

from __future__ import annotations

import logging
import os
import re

import torch

from kvmemory.errors import DeviceUnavailable, InvalidInput
from kvmemory.models.loading import is_embedded, is_gguf

log = logging.getLogger(__name__)

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPES = ("auto", "float32", "bfloat16", "float16")
_CUDA_INDEX = re.compile(r"cuda:(\d+)")


def graft_kernel() -> tuple[str, str]:
    """(the graft op's implementation, why): "cuda" where the kvmemory_cuda_graft kernel runs, else "twin"."""
    from kvmemory.kernels import graft_op

    return graft_op.IMPL, graft_op.IMPL_REASON


def cuda_devices() -> list[str]:
    """`cuda:i (name)` for every CUDA device torch sees ([] on a CPU build or without a device)."""
    if not torch.cuda.is_available():
        return []
    return [f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count())]


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA; install a CUDA build of torch"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device (no driver or GPU, or "
            f"CUDA_VISIBLE_DEVICES={visible!r} hides them)" if visible is not None else
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device (no GPU, or no driver)")


def status() -> dict:
    """What `kvmemory kernels` reports about GPUs: torch's CUDA, the devices, the graft kernel, and what
    `--device auto` gives for a Hugging Face model and for the embedded one."""
    impl, why = graft_kernel()
    return {"torch_cuda": torch.version.cuda, "devices": cuda_devices(),
            "graft_kernel": impl, "graft_kernel_reason": why,
            "auto_device": resolve_device("auto", model=None), "auto_device_embedded": "cpu"}


def resolve_device(requested: str | torch.device | None = "auto", *, model: str | None = None) -> str:
    """`requested` ("auto", "cpu", "cuda", "cuda:N", a torch.device; None = "auto") as the device to
    load on: "cpu" or "cuda:N". `model`: what will load (the embedded default stays on the CPU under
    "auto"; None = a Hugging Face model). Raises InvalidInput for another name, DeviceUnavailable for a
    CUDA device this machine does not have."""
    if requested is None:
        requested = "auto"
    if isinstance(requested, torch.device):
        requested = str(requested)
    if not isinstance(requested, str):
        raise InvalidInput(f"device must be one of {', '.join(DEVICE_CHOICES)}, not {requested!r}")
    text = requested.strip().lower()
    if text == "auto":
        if model is not None and (is_embedded(model) or is_gguf(model)):  # computed on the CPU
            return "cpu"
        impl, _ = graft_kernel()
        return _cuda(None) if impl == "cuda" and torch.cuda.is_available() else "cpu"
    if text == "cpu":
        return "cpu"
    if text == "cuda":
        return _cuda(None, requested)
    m = _CUDA_INDEX.fullmatch(text)
    if m:
        return _cuda(int(m.group(1)), requested)
    raise InvalidInput(f"device must be one of {', '.join(DEVICE_CHOICES)} (N: a GPU's index), not {requested!r}")


def _cuda(index: int | None, requested: str = "auto") -> str:
    if not torch.cuda.is_available():
        raise DeviceUnavailable(f"device {requested!r} was asked for, but {_why_no_cuda()}. Use --device cpu "
                                "(device='cpu'), or auto to take a GPU only where there is one")
    count = torch.cuda.device_count()
    if index is None:
        index = torch.cuda.current_device()
    if index >= count:
        raise DeviceUnavailable(f"device {requested!r} was asked for, but this machine has {count} CUDA "
                                f"device{'s' if count != 1 else ''}: {', '.join(cuda_devices())}. Use one of those")
    impl, why = graft_kernel()
    if impl != "cuda" and not _warned:
        _warned.append(why)  # said once per process: grafts are exact either way, only slower
        log.warning("kvmemory: the CUDA graft kernel is not used (%s); grafts on %s copy with torch's own "
                    "ops instead (the same bytes, slower): pip install -e kernels/cuda_graft", why, requested)
    return f"cuda:{index}"


_warned: list[str] = []


def resolve_dtype(requested: str | torch.dtype | None, device: str, *, profile: str = "default") -> torch.dtype | None:
    """The dtype to load in on `device` (resolved by resolve_device) for `requested` ("auto", a name of
    DTYPES or a torch.dtype; None = "auto"). None means transformers' own choice (the checkpoint's
    dtype), which "auto" keeps on the CPU and under the stock profile (it asks for float32 itself)."""
    if isinstance(requested, torch.dtype):
        if requested not in (torch.float32, torch.bfloat16, torch.float16):
            raise InvalidInput(f"dtype must be one of {', '.join(DTYPES)}, not {requested}")
        return requested
    if requested is None or requested == "auto":
        if profile == "stock" or not device.startswith("cuda"):
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if requested in DTYPES:
        return getattr(torch, requested)
    raise InvalidInput(f"dtype must be one of {', '.join(DTYPES)}, not {requested!r}")
