"""KVGraftLLM with real llama-index-core objects on the embedded SmolLM2: chat, complete, their
streaming and async forms, metadata, and the graft report every response carries."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from kvmemory import InvalidInput
from kvmemory.adapters.streaming import WORKER_THREAD_NAME
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, CompletionResponse, MessageRole
from llama_index.core.llms import LLM
from llama_index.llms.kvgraft import REPORT_KEYS, KVGraftLLM


def _user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role=MessageRole.USER, content=text)]


def test_metadata_reports_the_real_context_window(li_llm, li_memory):
    assert isinstance(li_llm, LLM)
    md = li_llm.metadata
    assert md.context_window == li_memory.engine.runner.max_positions == 8192
    assert md.num_output == li_llm.max_new_tokens
    assert md.is_chat_model is True and md.is_function_calling_model is True
    assert md.model_name == "embedded:smollm2-135m-instruct"
    assert KVGraftLLM.class_name() == "KVGraftLLM"


def test_chat_grafts_the_routed_solution_and_streams_the_same_text(li_llm, li_recurring, li_memory):
    msgs = _user(li_recurring.problems[0].rewordings[0])
    resp = li_llm.chat(msgs)
    assert isinstance(resp, ChatResponse) and resp.message.role == MessageRole.ASSISTANT
    assert resp.message.content and resp.message.content == li_llm.last_answer.text
    kw = resp.additional_kwargs
    assert set(REPORT_KEYS) <= set(kw)
    # The routed entry's stored chain is the prompt's prefix: all of it grafted (its last block a tail
    # block ending at the entry's end, a cut), the rest computed.
    assert kw["entries"] == [li_recurring.entry_for(0)] and kw["verified"] == [True]
    assert kw["tokens_grafted"] == len(li_memory.get(li_recurring.entry_for(0)).token_ids) > 0
    assert kw["tokens_grafted"] + kw["tokens_computed"] == kw["tokens_total"]
    assert 0 < kw["tokens_decoded"] <= li_llm.max_new_tokens
    assert kw["completion_tokens"] == kw["tokens_decoded"] and kw["prompt_tokens"] == kw["tokens_total"]
    assert len(kw["attestations"][0]) == 64
    assert resp.raw["tokens_grafted"] == kw["tokens_grafted"]

    chunks = list(li_llm.stream_chat(msgs))
    assert len(chunks) >= 2 and all(isinstance(c, ChatResponse) for c in chunks)
    assert "".join(c.delta or "" for c in chunks) == chunks[-1].message.content == resp.message.content
    for c in chunks[:-1]:
        assert chunks[-1].message.content.startswith(c.message.content)
    # Greedy decoding over the same grafted prefix: the same tokens, and the report on the last chunk.
    assert chunks[-1].additional_kwargs["tokens_grafted"] == kw["tokens_grafted"]
    assert chunks[-1].additional_kwargs["tokens_decoded"] == kw["tokens_decoded"]


def test_complete_and_stream_complete_with_a_stop_string(li_llm):
    prompt = "List three colours of the rainbow."
    full = li_llm.complete(prompt, route=False)
    assert isinstance(full, CompletionResponse) and full.additional_kwargs["entries"] == []
    words = full.text.split()
    assert len(words) >= 3, full.text
    stop = words[2]
    want = full.text[: full.text.index(stop)].strip()

    chunks = list(li_llm.stream_complete(prompt, route=False, stop=[stop]))
    assert chunks[-1].text == want
    assert "".join(c.delta or "" for c in chunks) == want
    assert all(stop not in (c.delta or "") for c in chunks)
    assert chunks[-1].additional_kwargs["tokens_decoded"] <= full.additional_kwargs["tokens_decoded"]
    assert li_llm.complete(prompt, route=False, stop=[stop]).text == want


def test_async_endpoints_give_the_sync_answers(li_llm):
    msgs = _user("Name a fruit that is yellow.")
    prompt = "Name an animal that can fly."
    opts = dict(route=False, max_new_tokens=6)
    sync_chat = li_llm.chat(msgs, **opts).message.content
    sync_complete = li_llm.complete(prompt, **opts).text

    async def run():
        achat = await li_llm.achat(msgs, **opts)
        acomplete = await li_llm.acomplete(prompt, **opts)
        schat = [c async for c in await li_llm.astream_chat(msgs, **opts)]
        scomplete = [c async for c in await li_llm.astream_complete(prompt, **opts)]
        return achat, acomplete, schat, scomplete

    achat, acomplete, schat, scomplete = asyncio.run(run())
    assert achat.message.content == sync_chat and acomplete.text == sync_complete
    assert "".join(c.delta or "" for c in schat) == schat[-1].message.content == sync_chat
    assert "".join(c.delta or "" for c in scomplete) == scomplete[-1].text == sync_complete
    assert schat[-1].additional_kwargs["tokens_decoded"] <= 6


def test_formatted_completion_continues_the_raw_text(li_llm, li_memory):
    prompt = "The capital of France is"
    resp = li_llm.complete(prompt, formatted=True, max_tokens=3)
    kw = resp.additional_kwargs
    assert kw["entries"] == [] and 0 < kw["tokens_decoded"] <= 3
    # No chat template around it: exactly the prompt's own tokens were read.
    assert kw["tokens_total"] == len(li_memory.engine.encode(prompt))


def test_an_abandoned_stream_stops_decoding_and_frees_the_engine(li_llm):
    gen = li_llm.stream_complete("Write a long story about a dragon.", route=False, max_new_tokens=200)
    first = next(gen)
    assert first.delta
    gen.close()
    deadline = time.monotonic() + 60
    while any(t.name == WORKER_THREAD_NAME for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(t.name == WORKER_THREAD_NAME for t in threading.enumerate())
    assert li_llm.last_answer is None or li_llm.last_answer.report.tokens_decoded < 200
    assert li_llm.complete("Say yes.", route=False, max_new_tokens=2).additional_kwargs["tokens_decoded"] <= 2


def test_errors_are_typed_and_raised_before_the_model(li_llm):
    with pytest.raises(InvalidInput, match="positions"):
        li_llm.complete("word " * 9000, route=False)
    with pytest.raises(InvalidInput):
        li_llm.complete("", formatted=True)
    with pytest.raises(TypeError):
        KVGraftLLM(memory=object())


def test_llms_opened_by_store_share_one_memory(tmp_path):
    a = KVGraftLLM(store=tmp_path / "shared-store", max_new_tokens=4)
    b = KVGraftLLM(store=str(tmp_path / "shared-store"))
    assert a.memory is b.memory
    assert a.memory.store.path == (tmp_path / "shared-store")
