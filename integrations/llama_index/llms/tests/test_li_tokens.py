"""The LlamaIndex tokenizer hook through the model's own tokenizer, offline: `Settings.tokenizer`,
the token limit of `ChatMemoryBuffer` and `Memory`, and the prompt count of a chat call."""

from __future__ import annotations

import time

import llama_index.core
import pytest
from kvmemory import InvalidInput
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.memory import ChatMemoryBuffer, Memory
from llama_index.core.settings import Settings
from llama_index.llms.kvgraft import KVGraftTokenizer, kvgraft_tokenizer

TEXT = "Tom has 3 boxes of 12 eggs and breaks 5. How many are left?"


def test_the_hook_gives_the_engines_own_ids(li_llm, monkeypatch):
    ids = li_llm.memory.engine.encode(TEXT)
    assert isinstance(li_llm.tokenizer, KVGraftTokenizer)
    assert li_llm.tokenizer(TEXT) == ids and li_llm.count_tokens(TEXT) == len(ids)
    # Without an engine: the default model's tokenizer files alone (no weights), the same ids.
    t0 = time.perf_counter()
    standalone = kvgraft_tokenizer()
    assert standalone(TEXT) == ids
    assert time.perf_counter() - t0 < 5.0  # offline and fast: no hub retries
    # LlamaIndex's global hook (restored after the test).
    monkeypatch.setattr(llama_index.core, "global_tokenizer", None)
    Settings.tokenizer = li_llm.tokenizer
    assert Settings.tokenizer(TEXT) == ids
    with pytest.raises(InvalidInput):
        li_llm.tokenizer(None)
    with pytest.raises(InvalidInput):
        kvgraft_tokenizer(3.5)


def _chat() -> list[ChatMessage]:
    texts = ["What is 12 times 9?", "12 times 9 is 108.", "And 12 times 7?", "12 times 7 is 84."]
    return [ChatMessage(role=MessageRole.USER if i % 2 == 0 else MessageRole.ASSISTANT, content=t)
            for i, t in enumerate(texts)]


def test_memory_token_limits_count_the_models_tokens(li_llm):
    msgs = _chat()
    enc = li_llm.memory.engine.encode
    # ChatMemoryBuffer counts the messages' texts joined by spaces: with the limit at exactly the last
    # two messages' count by the model's tokenizer, those two are what it keeps.
    last_two = len(enc(" ".join(m.content for m in msgs[-2:])))
    buf = ChatMemoryBuffer.from_defaults(chat_history=msgs, token_limit=last_two, tokenizer_fn=li_llm.tokenizer)
    assert buf.get() == msgs[-2:]
    assert ChatMemoryBuffer.from_defaults(chat_history=msgs, token_limit=len(enc(" ".join(m.content for m in msgs))),
                                          tokenizer_fn=li_llm.tokenizer).get() == msgs

    # Memory (LlamaIndex's newer memory) counts each message's text blocks.
    mem = Memory.from_defaults(session_id="li-tokens", token_limit=10_000, tokenizer_fn=li_llm.tokenizer)
    mem.put_messages(msgs)
    assert mem._estimate_token_count(msgs) == sum(len(enc(m.content)) for m in msgs) + sum(
        len(enc(str(m.additional_kwargs))) for m in msgs if m.additional_kwargs)
    assert mem.get() == msgs


def test_message_count_equals_the_prompt_a_chat_reads(li_llm):
    msgs = [ChatMessage(role=MessageRole.SYSTEM, content="Answer briefly."),
            ChatMessage(role=MessageRole.USER, content="Name a colour.")]
    resp = li_llm.chat(msgs, route=False, max_new_tokens=2)
    assert li_llm.count_message_tokens(msgs) == resp.additional_kwargs["prompt_tokens"]
