"""Concurrent Python callers sharing forward steps (`kvmemory.share_steps`, engine/scheduler.py): LangChain's
`batch` and `abatch` over the real ChatKVGraft on the embedded model give each prompt the very answer it gets
alone, while their forwards share steps (the scheduler saw steps of several rows); a lone
caller never enters the batch; `share_steps(memory, False)` ends it.
"""

from __future__ import annotations

import asyncio

import pytest

from kvmemory import KVMemory, share_steps

PROMPTS = ["Name a color.", "What is 2 + 2?", "Say hello to Ana.", "Name a fruit.", "What is the capital of Italy?"]


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    mem = KVMemory(store=tmp_path_factory.mktemp("share") / "store")
    yield mem
    share_steps(mem, False)


def _widest(scheduler) -> list[int]:
    """Wrap the scheduler's batch so every step's row count is recorded."""
    seen: list[int] = []
    step = scheduler.batch.step

    def counted():
        more = step()
        seen.append(scheduler.batch.last_rows)
        return more

    scheduler.batch.step = counted
    return seen


def test_langchain_batch_and_abatch_share_steps_and_answer_as_alone(memory):
    from langchain_kvmemory import ChatKVGraft

    llm = ChatKVGraft(memory=memory, max_tokens=12, route=False)
    alone = [llm.invoke(p) for p in PROMPTS]
    share_steps(memory)
    scheduler = memory.engine.batcher
    assert scheduler is not None and scheduler.when_busy
    seen = _widest(scheduler)
    assert llm.invoke(PROMPTS[0]).content == alone[0].content and not seen  # a lone call: no batch
    together = llm.batch(PROMPTS, config={"max_concurrency": len(PROMPTS)})
    assert [m.content for m in together] == [m.content for m in alone]
    assert max(seen) > 1, seen  # rows of several calls in one step
    seen.clear()
    again = asyncio.run(llm.abatch(PROMPTS))
    assert [m.content for m in again] == [m.content for m in alone]
    assert max(seen) > 1, seen
    share_steps(memory, False)
    assert memory.engine.batcher is None
    assert llm.invoke(PROMPTS[1]).content == alone[1].content


def test_llamaindex_async_chats_share_steps_and_answer_as_alone(memory):
    from llama_index.core.base.llms.types import ChatMessage, MessageRole
    from llama_index.llms.kvgraft import KVGraftLLM

    llm = KVGraftLLM(memory=memory, max_new_tokens=12, route=False)
    chats = [[ChatMessage(role=MessageRole.USER, content=p)] for p in PROMPTS]
    alone = [llm.chat(c).message.content for c in chats]
    share_steps(memory)
    try:
        seen = _widest(memory.engine.batcher)

        async def together():
            return await asyncio.gather(*(llm.achat(c) for c in chats))

        assert [r.message.content for r in asyncio.run(together())] == alone
        assert max(seen) > 1, seen
    finally:
        share_steps(memory, False)
