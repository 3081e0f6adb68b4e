"""`device` / `dtype` on the LlamaIndex KVMemoryBlock: passed to the memory it opens; a GPU that is not
here is kvmemory's typed DeviceUnavailable (not pydantic's ValidationError) at construction."""

from __future__ import annotations

import pytest
import torch

from kvmemory import DeviceUnavailable
from llama_index.memory.kvmemory import KVMemoryBlock


def test_the_block_opens_its_memory_on_the_device_asked(tiny_model_folder, tmp_path):
    block = KVMemoryBlock(store=tmp_path / "s", model=tiny_model_folder, device="cpu")
    assert block.memory.engine.device == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailable):
            KVMemoryBlock(store=tmp_path / "t", model=tiny_model_folder, device="cuda")
