"""ctypes binding of libkvgraft.so (no torch: callers pass raw pointers and a stream handle).

The structs mirror `kvgraft_block` / `kvgraft_layer` in csrc/kvgraft.cu field for field; the ABI
version exported by the library guards against a stale binary.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

ABI_VERSION = 2


class CudaGraftError(RuntimeError):
    """The library returned an error code (a CUDA error or a kvmemory_cuda_graft argument error)."""

    def __init__(self, code: int, message: str):
        super().__init__(f"{message} (code {code})")
        self.code = code


class Block(ctypes.Structure):
    """One block of the chain (32 bytes): payload at staging+src_offset covers tokens
    [pos, pos + tokens)."""

    _fields_ = [
        ("src_offset", ctypes.c_int64),
        ("pos", ctypes.c_int64),
        ("tokens", ctypes.c_int64),
        ("reserved", ctypes.c_int64),
    ]


class Layer(ctypes.Structure):
    """One destination layer (80 bytes). dst_k / dst_v: device pointers to contiguous [1, Hk, S, Dk] /
    [1, Hv, S, Dv]; payload_prefix: bytes per token of all earlier layers (sum (Hk*Dk + Hv*Dv)*esize);
    row_prefix: sum of Hk + Hv over earlier layers."""

    _fields_ = [
        ("dst_k", ctypes.c_uint64),
        ("dst_v", ctypes.c_uint64),
        ("k_heads", ctypes.c_int64),
        ("k_dim", ctypes.c_int64),
        ("v_heads", ctypes.c_int64),
        ("v_dim", ctypes.c_int64),
        ("seq", ctypes.c_int64),
        ("dst_off", ctypes.c_int64),
        ("payload_prefix", ctypes.c_int64),
        ("row_prefix", ctypes.c_int64),
    ]


assert ctypes.sizeof(Block) == 32 and ctypes.sizeof(Layer) == 80


class Library:
    """A loaded libkvgraft.so."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        lib = ctypes.CDLL(str(self.path))
        lib.kvgraft_abi_version.restype = ctypes.c_int
        lib.kvgraft_abi_version.argtypes = []
        lib.kvgraft_error_string.restype = ctypes.c_char_p
        lib.kvgraft_error_string.argtypes = [ctypes.c_int]
        lib.kvgraft_cuda_versions.restype = ctypes.c_int
        lib.kvgraft_cuda_versions.argtypes = [ctypes.POINTER(ctypes.c_int)] * 2
        lib.kvgraft_copy.restype = ctypes.c_int
        lib.kvgraft_copy.argtypes = [
            ctypes.c_int,                # device ordinal
            ctypes.c_void_p,             # staging (device or pinned host pointer)
            ctypes.POINTER(Block), ctypes.c_int,
            ctypes.POINTER(Layer), ctypes.c_int,
            ctypes.c_int64,              # element size in bytes
            ctypes.c_void_p,             # cudaStream_t (0 = legacy default stream)
        ]
        lib.kvgraft_emulate.restype = ctypes.c_int
        lib.kvgraft_emulate.argtypes = [
            ctypes.c_void_p, ctypes.POINTER(Block), ctypes.c_int, ctypes.POINTER(Layer), ctypes.c_int,
            ctypes.c_int64, ctypes.c_int,
        ]
        abi = lib.kvgraft_abi_version()
        if abi != ABI_VERSION:
            raise CudaGraftError(-1, f"{self.path} has ABI {abi}, this kvmemory_cuda_graft expects {ABI_VERSION}; rebuild it")
        self._lib = lib

    def error_string(self, code: int) -> str:
        return self._lib.kvgraft_error_string(code).decode("utf-8", "replace")

    def cuda_versions(self) -> tuple[int, int, int]:
        """(status, runtime version, driver version), e.g. (0, 13000, 13000); driver 0 = none."""
        rt, drv = ctypes.c_int(0), ctypes.c_int(0)
        code = self._lib.kvgraft_cuda_versions(ctypes.byref(rt), ctypes.byref(drv))
        return code, rt.value, drv.value

    def copy(self, device: int, staging_ptr: int, blocks: Sequence[Block] | ctypes.Array,
             layers: Sequence[Layer] | ctypes.Array, esize: int, stream: int) -> None:
        """Launches the graft kernel (asynchronous). Raises CudaGraftError on any error code."""
        barr = blocks if isinstance(blocks, ctypes.Array) else (Block * len(blocks))(*blocks)
        larr = layers if isinstance(layers, ctypes.Array) else (Layer * len(layers))(*layers)
        code = self._lib.kvgraft_copy(
            int(device), ctypes.c_void_p(staging_ptr), barr, len(barr), larr, len(larr),
            int(esize), ctypes.c_void_p(stream or None),
        )
        if code != 0:
            raise CudaGraftError(code, self.error_string(code))

    def emulate(self, staging_ptr: int, blocks: Sequence[Block] | ctypes.Array,
                layers: Sequence[Layer] | ctypes.Array, esize: int, threads: int = 256) -> None:
        """Runs the kernel's per-job code on the CPU over HOST pointers (test hook; synchronous)."""
        barr = blocks if isinstance(blocks, ctypes.Array) else (Block * len(blocks))(*blocks)
        larr = layers if isinstance(layers, ctypes.Array) else (Layer * len(layers))(*layers)
        code = self._lib.kvgraft_emulate(ctypes.c_void_p(staging_ptr), barr, len(barr), larr,
                                         len(larr), int(esize), int(threads))
        if code != 0:
            raise CudaGraftError(code, self.error_string(code))
