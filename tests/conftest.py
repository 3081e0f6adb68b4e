"""Shared fixtures: tiny random-init models from configs (the architecture matrix), the embedded
SmolLM2 (loaded once per session), and throw-away stores."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import pytest
import torch

from kvmemory.engine.engine import Engine
from kvmemory.kernels import native
from kvmemory.models.loading import LoadedModel
from kvmemory.store.local import LocalStore

from tiny_models import ARCHS, TINY_VOCAB, IdTokenizer, tiny_config, tiny_engine, tiny_model  # noqa: F401


@pytest.fixture
def store_dir(tmp_path):
    return tmp_path / "store"


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2 (converted once into the cache folder, then loaded from safetensors)."""
    from kvmemory.models.loading import load_model

    return load_model()


@pytest.fixture
def real_memory(smollm, tmp_path):
    from kvmemory.memory.facade import KVMemory

    return KVMemory(Engine(smollm, LocalStore(tmp_path / "store")))


@pytest.fixture
def lib_copy(tmp_path, monkeypatch) -> Path:
    """A copy of the installed libraries and manifest that a test may damage, used by the loader."""
    lib = tmp_path / "lib"
    shutil.copytree(native.LIB_DIR, lib)
    monkeypatch.setattr(native, "LIB_DIR", lib)
    native.clear()
    yield lib
    monkeypatch.undo()
    native.clear()
