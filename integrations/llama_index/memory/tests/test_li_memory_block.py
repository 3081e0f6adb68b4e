"""KVMemoryBlock inside LlamaIndex's real `Memory`: gets verified solutions into the system message,
and stores the turns `Memory` flushes only when the verifier accepts them."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.memory import Memory
from llama_index.core.memory.memory import BaseMemoryBlock, InsertMethod
from llama_index.core.storage.chat_store.sql import MessageStatus
from llama_index.memory.kvmemory import KVMemoryBlock


def _tokenizer_fn(li_memory):
    # Count tokens with the model's own tokenizer (LlamaIndex's default is an OpenAI BPE).
    tok = li_memory.engine.tokenizer
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


def test_get_puts_the_routed_verified_solution_in_the_system_message(li_memory, li_recurring):
    block = KVMemoryBlock(memory=li_memory, namespace=li_recurring.namespace, similarity_top_k=1)
    assert isinstance(block, BaseMemoryBlock)
    memory = Memory.from_defaults(session_id="li-get", token_limit=4000, memory_blocks=[block],
                                  tokenizer_fn=_tokenizer_fn(li_memory))
    problem = li_recurring.problems[4]
    memory.put(ChatMessage(role=MessageRole.USER, content=problem.rewordings[1]))
    messages = memory.get()

    assert messages[0].role == MessageRole.SYSTEM
    system = messages[0].content
    assert "<verified_solutions>" in system
    assert problem.text in system and problem.solution in system
    # Only the best one (similarity_top_k=1), and the user's own message follows untouched.
    others = [p for i, p in enumerate(li_recurring.problems) if i != 4]
    assert not any(p.solution in system for p in others)
    assert messages[-1].content == problem.rewordings[1]

    # An unrelated question gets nothing from the block.
    memory.put(ChatMessage(role=MessageRole.USER, content="What is the tallest mountain on Mars?"))
    assert all("<verified_solutions>" not in (m.content or "") for m in memory.get())


def test_insert_into_the_user_message(li_memory, li_recurring):
    block = KVMemoryBlock(memory=li_memory, namespace=li_recurring.namespace, similarity_top_k=1)
    memory = Memory.from_defaults(session_id="li-user", token_limit=4000, memory_blocks=[block],
                                  tokenizer_fn=_tokenizer_fn(li_memory), insert_method=InsertMethod.USER)
    problem = li_recurring.problems[5]
    memory.put(ChatMessage(role=MessageRole.USER, content=problem.rewordings[0]))
    last = memory.get()[-1]
    assert last.role == MessageRole.USER and problem.solution in last.content
    assert problem.rewordings[0] in last.content


def test_flushed_turns_are_stored_only_when_verified(li_memory):
    ns = "li-memory-put"
    block = KVMemoryBlock(memory=li_memory, namespace=ns)
    memory = Memory.from_defaults(session_id="li-put", token_limit=20, token_flush_size=10, memory_blocks=[block],
                                  tokenizer_fn=_tokenizer_fn(li_memory))
    good_q = "Ravi packs 7 crates with 8 jars in each crate. How many jars does he pack?"
    bad_q = "Ines reads 9 pages a day for 9 days. How many pages does she read?"
    turns = [
        ChatMessage(role=MessageRole.USER, content=good_q),
        ChatMessage(role=MessageRole.ASSISTANT, content="7 * 8 = 56. The answer is 56.",
                    additional_kwargs={"answer": "56"}),
        ChatMessage(role=MessageRole.USER, content=bad_q),
        ChatMessage(role=MessageRole.ASSISTANT, content="9 * 9 = 80. The answer is 80."),
        ChatMessage(role=MessageRole.USER, content="Thanks!"),
        ChatMessage(role=MessageRole.ASSISTANT, content="You are welcome."),
    ]
    memory.put_messages(turns)

    # Memory flushed the two older turns into the block (20 tokens leave room for the last one only).
    assert [m.content for m in memory.get_all(status=MessageStatus.ACTIVE)] == ["Thanks!", "You are welcome."]
    assert [e.problem for e in block.remembered] == [good_q]
    entry = block.remembered[0]
    assert entry.verified and entry.answer == "56" and entry.namespace == ns
    assert [r.problem for r in block.rejected] == [bad_q]
    assert "wrong arithmetic" in block.rejected[0].reason
    # What was stored comes back on a get; what was refused never entered the store.
    assert [h.entry.id for h in block.recall("How many jars does Ravi pack into 7 crates of 8?")] == [entry.id]
    assert block.recall(bad_q) == []
    text = asyncio.run(block.aget([ChatMessage(role=MessageRole.USER, content="Ravi packs 7 crates of 8 jars. Jars?")]))
    assert "7 * 8 = 56" in text


def test_unverified_entries_are_left_out_unless_asked_for(li_memory):
    ns = "li-memory-unverified"
    q = "Oskar has 5 bags of 4 apples. How many apples does he have?"
    li_memory.remember(q, "5 * 4 = 21. The answer is 21.", "21", verifier="arithmetic", namespace=ns,
                       allow_unverified=True)
    msgs = [ChatMessage(role=MessageRole.USER, content=q)]
    assert asyncio.run(KVMemoryBlock(memory=li_memory, namespace=ns).aget(msgs)) == ""
    got = asyncio.run(KVMemoryBlock(memory=li_memory, namespace=ns, include_unverified=True).aget(msgs))
    assert "5 * 4 = 21" in got


def test_truncation_drops_whole_solutions_from_the_end(li_memory, li_recurring):
    block = KVMemoryBlock(memory=li_memory, namespace=li_recurring.namespace, similarity_top_k=3, threshold=-1.0)
    msgs = [ChatMessage(role=MessageRole.USER, content=li_recurring.problems[6].rewordings[0])]
    content = asyncio.run(block.aget(msgs))
    parts = content.split("\n\n")
    assert len(parts) == 3 and li_recurring.problems[6].text in parts[0]
    kept = asyncio.run(block.atruncate(content, 1))
    assert kept == "\n\n".join(parts[:2])
    assert asyncio.run(block.atruncate(content, 10_000)) is None


def test_construction(li_memory):
    from kvmemory import InvalidInput

    # Bad fields: kvmemory's typed error (a ValueError), not pydantic's.
    with pytest.raises(InvalidInput):
        KVMemoryBlock(memory=li_memory, similarity_top_k=0)
    with pytest.raises(InvalidInput):
        KVMemoryBlock(memory="not a memory")
    with pytest.raises(InvalidInput, match="unknown verifier"):
        KVMemoryBlock(memory=li_memory, verifier="trust-me")
    with pytest.raises(InvalidInput):
        KVMemoryBlock(memory=li_memory, namespace=5)
    block = KVMemoryBlock(memory=li_memory, name="solutions", priority=2)
    assert block.name == "solutions" and block.priority == 2 and block.memory is li_memory
    # The block serializes without its KVMemory (a model is not configuration).
    assert "memory" not in block.model_dump()


def test_bad_inputs_are_refused_typed(li_memory):
    from kvmemory import InvalidInput

    block = KVMemoryBlock(memory=li_memory, namespace="li-block-bad-inputs")
    for bad in (None, 3, b"q"):
        with pytest.raises(InvalidInput):
            block.recall(bad)
    with pytest.raises(InvalidInput):
        block.remember(None, "2 + 2 = 4. The answer is 4.")
    with pytest.raises(InvalidInput):
        block.remember("What is 2 + 2?", 4)
    with pytest.raises(InvalidInput):
        block.remember("What is 2 + 2?", "2 + 2 = 4.", answer=4)
    for bad in ("hello", ["hello"], ChatMessage(role=MessageRole.USER, content="hi")):
        with pytest.raises(InvalidInput):
            asyncio.run(block.aget(bad))
        with pytest.raises(InvalidInput):
            asyncio.run(block.aput(bad))
    with pytest.raises(InvalidInput):
        asyncio.run(block.atruncate(5, 10))
    with pytest.raises(InvalidInput):
        asyncio.run(block.atruncate("text", "many"))
    # Nothing was stored or counted as rejected: the calls were refused, not attempted.
    assert block.remembered == [] and block.rejected == []


def test_a_users_statements_are_put_as_notes_and_got_back(li_memory):
    # Issue 41: a fact the user stated is kept (a note: unverified, kind "note") and comes back for a
    # question about it, although a question scores below the threshold that routes solutions.
    from kvmemory import kind_of

    ns = "li-memory-notes"
    block = KVMemoryBlock(memory=li_memory, namespace=ns)
    asyncio.run(block.aput([ChatMessage(role=MessageRole.USER, content="Thanks! Alice has a cat named Tom."),
                            ChatMessage(role=MessageRole.ASSISTANT, content="Noted.")]))
    assert [(e.problem, e.verified, kind_of(e)) for e in block.remembered] == [("Alice has a cat named Tom.", False, "note")]
    assert block.rejected == []
    question = [ChatMessage(role=MessageRole.USER, content="What pet does Alice have?")]
    assert asyncio.run(block.aget(question)) == "Note: Alice has a cat named Tom."
    assert asyncio.run(block.aget([ChatMessage(role=MessageRole.USER, content="What is the tallest mountain on Mars?")])) == ""
    assert asyncio.run(KVMemoryBlock(memory=li_memory, namespace=ns, include_notes=False).aget(question)) == ""
    # Inside LlamaIndex's Memory: the note goes into the system message.
    memory = Memory.from_defaults(session_id="li-notes", token_limit=4000, memory_blocks=[block],
                                  tokenizer_fn=_tokenizer_fn(li_memory))
    memory.put(question[0])
    system = memory.get()[0]
    assert system.role == MessageRole.SYSTEM and "Note: Alice has a cat named Tom." in system.content
