"""`device` / `dtype` on every langchain-kvmemory class that opens a model: passed to the memory it
opens (kvmemory's shared one per model, store, device and dtype), a device that is not here refused at
construction with kvmemory's typed DeviceUnavailable, and a memory given with a device it does not run
on refused rather than the option ignored."""

from __future__ import annotations

import pytest
import torch
from lc_testutil import fresh_store, tiny_model_path

from kvmemory import DeviceUnavailable, InvalidInput, KVMemory
from langchain_kvmemory import ChatKVGraft, KVMemoryRetriever, KVMemoryStore, create_remember_tool

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU says")


def test_the_chat_model_opens_its_model_on_the_device_and_in_the_dtype_asked():
    llm = ChatKVGraft(model=tiny_model_path(), store=fresh_store(), device="cpu", dtype="float32", max_tokens=2,
                      route=False)
    msg = llm.invoke("Tom has 3 boxes of 12 eggs. How many eggs?")
    eng = llm.shared().memory.engine
    assert eng.device == torch.device("cpu") and eng.profile.dtype == "float32"
    assert msg.usage_metadata["output_tokens"] >= 1
    assert llm._identifying_params["device"] == "cpu" and llm._identifying_params["dtype"] == "float32"
    # The retriever on the same model, store and device borrows the same memory (one model loaded).
    retriever = KVMemoryRetriever(model=tiny_model_path(), store=llm.store, device="cpu", dtype="float32")
    assert retriever.shared().memory is llm.shared().memory


@no_gpu
@pytest.mark.parametrize("make", [
    lambda d: ChatKVGraft(model=tiny_model_path(), store=fresh_store(), device=d),
    lambda d: KVMemoryRetriever(model=tiny_model_path(), store=fresh_store(), device=d),
    lambda d: KVMemoryStore(model=tiny_model_path(), store=fresh_store(), device=d),
    lambda d: create_remember_tool(model=tiny_model_path(), store=fresh_store(), device=d),
], ids=["chat", "retriever", "store", "tool"])
def test_a_gpu_that_is_not_here_is_refused_at_construction(make):
    with pytest.raises(DeviceUnavailable, match="'cuda:1' was asked for"):
        make("cuda:1")
    with pytest.raises(InvalidInput, match="auto, cpu, cuda, cuda:N"):
        make("gpu")


def test_a_memory_given_must_run_where_the_options_say(tmp_path):
    mem = KVMemory(model=tiny_model_path(), store=tmp_path / "s", device="cpu")
    llm = ChatKVGraft(memory=mem, device="cpu")  # the same: fine
    assert llm.shared().memory is mem
    store = KVMemoryStore(memory=mem, dtype="bfloat16")
    with pytest.raises(InvalidInput, match="computes in float32"):
        store.shared()
