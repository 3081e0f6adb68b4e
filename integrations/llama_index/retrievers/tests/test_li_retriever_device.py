"""`device` / `dtype` on the LlamaIndex KVMemoryRetriever: passed to the memory it opens; a GPU that is
not here is kvmemory's typed DeviceUnavailable at construction."""

from __future__ import annotations

import pytest
import torch

from kvmemory import DeviceUnavailable, InvalidInput
from llama_index.retrievers.kvmemory import KVMemoryRetriever


def test_the_retriever_opens_its_memory_on_the_device_asked(tiny_model_folder, tmp_path):
    r = KVMemoryRetriever(store=tmp_path / "s", model=tiny_model_folder, device="cpu", dtype="float32")
    assert r.memory.engine.device == torch.device("cpu") and r.memory.engine.profile.dtype == "float32"
    assert r.retrieve("how many eggs?") == []  # an empty store routes nowhere
    with pytest.raises(InvalidInput, match="computes in float32"):
        KVMemoryRetriever(r.memory, dtype="float16")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailable):
            KVMemoryRetriever(store=tmp_path / "t", model=tiny_model_folder, device="cuda:3")
