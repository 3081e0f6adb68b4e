"""`device` / `dtype` on KVGraftLLM: the memory it opens runs there; a GPU that is not here is kvmemory's
typed DeviceUnavailable at construction; a memory given with another dtype is refused, not ignored."""

from __future__ import annotations

import pytest
import torch

from kvmemory import DeviceUnavailable, InvalidInput
from llama_index.core.llms import ChatMessage
from llama_index.llms.kvgraft import KVGraftLLM


def test_the_llm_opens_its_model_on_the_device_asked(tiny_model_folder, tmp_path):
    llm = KVGraftLLM(model=tiny_model_folder, store=tmp_path / "s", device="cpu", dtype="float32", max_new_tokens=2,
                     route=False)
    assert llm.memory.engine.device == torch.device("cpu") and llm.memory.engine.profile.dtype == "float32"
    assert llm.chat([ChatMessage(role="user", content="How many eggs?")]).message.content is not None
    assert KVGraftLLM(llm.memory, device="cpu").memory is llm.memory
    with pytest.raises(InvalidInput, match="computes in float32"):
        KVGraftLLM(llm.memory, dtype="bfloat16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU says")
def test_a_gpu_that_is_not_here_is_refused(tiny_model_folder, tmp_path):
    with pytest.raises(DeviceUnavailable, match="'cuda' was asked for"):
        KVGraftLLM(model=tiny_model_folder, store=tmp_path / "s", device="cuda")
