"""kvmemory.adapters: what the LangChain and LlamaIndex adapters share.

- the text protocol (messages as turns, tool calls, tool_choice spellings, schema resolution) and the
  visible-text filter, without a model;
- streaming's worker thread with a plain decode-like function: deltas add up to the final text, errors
  reach the consumer, and a consumer that stops (closed generator, cancelled task) stops the work and
  frees its lock;
- with the embedded SmolLM2 and the real frameworks: LangChain's `.stream()` / `.astream()` and
  LlamaIndex's `stream_chat` / `astream_chat` abandoned after their first chunk stop decoding and free
  the memory's lock at once, not after the decode; `run_chat` decodes what `KVMemory.chat` decodes; a
  system prompt's blocks are stored by the first call and grafted by the next.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import suppress

import pytest

from kvmemory import (ChatRequest, KVMemory, Message, StreamCancelled, ToolChoiceError, UnsupportedContent, VisibleText,
                      astream_text, borrow_memory, memory_lock, normalize_tool_choice, parse_tool_calls,
                      render_tool_call, run_chat, stream_text, text_of, to_turns)
from kvmemory.adapters.guided import fields_of, resolve
from kvmemory.adapters.messages import with_instructions
from kvmemory.adapters.streaming import WORKER_THREAD_NAME

# A stream whose consumer went away must stop at the token being decoded; its worker is given this
# long to unwind (one token takes well under a second even on a loaded 2-core machine).
STOP_WITHIN_S = 10.0
LONG = 400  # what an abandoned chat stream would otherwise decode (the counting prompt runs > 100 tokens)


# ---------------------------------------------------------------------- text, without a model
def _feed(vis: VisibleText, pieces: list[str]) -> list[str]:
    return [vis.add(p) for p in pieces]


def test_visible_text_holds_back_whitespace_and_partial_stop_strings():
    vis = VisibleText()
    assert _feed(vis, ["\n", " Hello", " ", "world", "  "]) == ["", "Hello", "", " world", ""]
    assert vis.finish("Hello world") == ""

    vis = VisibleText(["Observation:"])
    deltas = _feed(vis, ["Action: add", "\nObs", "ervation", ": 19"])
    assert deltas == ["Action: add", "", "", ""]
    assert vis.finish("Action: add") == ""

    # A false alarm is released once it can no longer become a stop string.
    assert _feed(VisibleText(["STOP"]), ["go ST", "ill"]) == ["go", " STill"]
    assert _feed(VisibleText(["you"]), ["  Hello yo"]) == ["Hello"]
    assert _feed(VisibleText(["<tool_call>"]), ["a <tool"]) == ["a"]
    # The earliest of several stop strings cuts.
    assert _feed(VisibleText(["b", "a"]), ["xx a b"]) == ["xx"]


@pytest.mark.parametrize("final", ["abc", "abc def", "rewritten"])
def test_finish_makes_the_deltas_add_up_to_the_final_text_when_it_continues_them(final):
    vis = VisibleText()
    shown = vis.add("abc")
    last = vis.finish(final)
    assert shown + last == (final if final.startswith("abc") else "abc")


def test_to_turns_lays_out_every_framework_the_same_way():
    turns = to_turns([
        Message("system", "be brief "), Message("developer", "be kind"), Message("human", "What is 1 + 2"),
        Message("ai", "", [("add", {"a": 1, "b": 2})]), Message("tool", "3"), Message("function", "boom", error=True),
        Message("chatbot", [{"type": "text", "text": " fine "}, {"type": "thinking", "thinking": "hmm"}]),
        Message("critic", "x"),
    ])
    assert turns == [
        {"role": "system", "content": "be brief\n\nbe kind"},
        {"role": "user", "content": "What is 1 + 2"},
        {"role": "assistant", "content": render_tool_call("add", {"a": 1, "b": 2})},
        {"role": "tool", "content": "3"},
        {"role": "tool", "content": "Error: boom"},
        {"role": "assistant", "content": "fine"},
        {"role": "critic", "content": "x"},  # a role the template may know is passed on
    ]
    assert [t["role"] for t in to_turns([Message("tool", "3")], tool_role="user")] == ["user"]
    assert with_instructions(turns[1:2], "tools", "") == [{"role": "system", "content": "tools"}, turns[1]]
    assert with_instructions(turns[:1], "tools")[0]["content"] == "be brief\n\nbe kind\n\ntools"
    assert turns[0]["content"] == "be brief\n\nbe kind"  # the input is not changed


def test_text_of_reads_text_blocks_and_refuses_images():
    assert text_of([{"type": "text", "text": "a"}, {"type": "tool_use", "id": "x", "name": "t", "input": {}},
                    {"type": "text", "text": "b"}]) == "ab"
    with pytest.raises(UnsupportedContent):
        text_of([{"type": "image", "base64": "AAAA", "mime_type": "image/png"}])
    with pytest.raises(UnsupportedContent):
        text_of([{"type": "hologram"}])


def test_parse_tool_calls_tagged_bare_and_invalid():
    rest, calls, bad = parse_tool_calls('ok <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', ["add"])
    assert rest == "ok" and calls[0]["name"] == "add" and calls[0]["args"] == {"a": 1} and not bad
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "tool_call"
    rest, calls, bad = parse_tool_calls('{"tool": "add", "arguments": {"a": 2}}', ["add"])
    assert calls[0]["args"] == {"a": 2} and rest == ""
    rest, calls, bad = parse_tool_calls('the JSON {"name": "other", "x": 1} stays text', ["add"])
    assert not calls and not bad and rest.startswith("the JSON")
    _, calls, bad = parse_tool_calls("<tool_call>{not json}</tool_call>", ["add"])
    assert not calls and bad[0]["error"].startswith("not JSON") and bad[0]["type"] == "invalid_tool_call"
    _, calls, bad = parse_tool_calls('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', ["add"])
    assert not calls and "nope" in bad[0]["error"]


def test_tool_choice_spellings():
    names = ["add", "mul"]
    assert normalize_tool_choice(None, names) == "auto"
    assert normalize_tool_choice("none", names) == "none"
    for any_ in ("any", "required", True, {"type": "any"}):
        assert normalize_tool_choice(any_, names) == "any"
    assert normalize_tool_choice("mul", names) == "mul"
    assert normalize_tool_choice({"type": "function", "function": {"name": "add"}}, names) == "add"
    assert normalize_tool_choice({"type": "tool", "name": "add"}, names) == "add"
    with pytest.raises(ToolChoiceError):
        normalize_tool_choice("div", names)
    with pytest.raises(ToolChoiceError):
        normalize_tool_choice("any", [])


def test_schema_resolution_follows_refs_and_unions():
    root = {"$defs": {"P": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
            "type": "object", "properties": {"p": {"$ref": "#/$defs/P"},
                                             "o": {"anyOf": [{"type": "null"}, {"type": "string"}]}},
            "required": ["p"]}
    assert resolve(root["properties"]["p"], root)["properties"]["n"]["type"] == "integer"
    assert resolve(root["properties"]["o"], root)["type"] == "string"
    assert fields_of(root) == ["p"]
    assert fields_of({"type": "object", "properties": {"a": {}, "b": {}}}) == ["a", "b"]


# ---------------------------------------------------------------------- streaming, with a decode-like function
class _Final:
    def __init__(self, text: str):
        self.text = text


def _decoder(lock: threading.RLock, steps: int, progress: list[int], delay: float = 0.01):
    """Work that holds `lock` and reports one piece of text every `delay` seconds, as a decode does."""

    def work(on_text):
        with lock:
            for i in range(steps):
                on_text(f" w{i}")
                progress.append(i)
                time.sleep(delay)
            return _Final(" ".join(f"w{i}" for i in range(steps)))

    return work


def _workers_gone(within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(t.name == WORKER_THREAD_NAME for t in threading.enumerate()):
            return True
        time.sleep(0.02)
    return False


def test_stream_text_delivers_visible_deltas_and_the_result_last():
    chunks = list(stream_text(_decoder(threading.RLock(), 5, [], delay=0), stop=["w4"]))
    *text, last = chunks
    assert all(c.result is None and c.delta for c in text)
    assert last.result.text == "w0 w1 w2 w3 w4"
    assert "".join(c.delta for c in chunks) == "w0 w1 w2 w3 w4" == last.text


def test_the_workers_error_is_raised_in_the_consumer():
    def work(on_text):
        on_text("partial")
        raise ValueError("the model refused")

    with pytest.raises(ValueError, match="refused"):
        list(stream_text(work))


def test_closing_a_stream_stops_the_work_and_frees_its_lock():
    lock, progress = threading.RLock(), []
    gen = stream_text(_decoder(lock, 10_000, progress))
    assert next(gen).delta == "w0"
    gen.close()
    assert _workers_gone(STOP_WITHIN_S)
    assert lock.acquire(timeout=0.1)
    lock.release()
    assert len(progress) < 1000  # stopped at the next piece of text, not at the end


def test_an_abandoned_stream_is_stopped_when_it_is_collected():
    lock, progress = threading.RLock(), []

    def consume_one():
        return next(stream_text(_decoder(lock, 10_000, progress)))  # the generator is dropped here

    assert consume_one().delta == "w0"
    assert _workers_gone(STOP_WITHIN_S)
    assert lock.acquire(timeout=0.1)
    lock.release()


def _cancel_after_first_chunk(open_stream, before_cancel=lambda: None) -> None:
    """Consume the async stream `await open_stream()` in a task and cancel the task once a chunk with
    text has arrived (`before_cancel` runs just before)."""

    async def main():
        first = asyncio.Event()

        async def consume():
            async for chunk in await open_stream():
                if getattr(chunk, "delta", None) or getattr(chunk, "content", None):
                    first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        before_cancel()
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_cancelling_the_consuming_task_stops_an_async_stream():
    lock, progress = threading.RLock(), []

    async def open_stream():
        return astream_text(_decoder(lock, 10_000, progress))

    _cancel_after_first_chunk(open_stream)
    assert _workers_gone(STOP_WITHIN_S)
    assert lock.acquire(timeout=0.1)
    lock.release()
    assert len(progress) < 1000


def test_a_silent_check_raises_once_cancelled():
    seen: list[BaseException] = []

    def work(on_text):
        on_text("x")
        try:
            while True:
                on_text("")  # a pass whose text is not shown only checks
                time.sleep(0.01)
        except StreamCancelled as exc:
            seen.append(exc)
            raise
        return _Final("x")

    gen = stream_text(work)
    assert next(gen).delta == "x"
    gen.close()
    assert _workers_gone(STOP_WITHIN_S) and len(seen) == 1


# ---------------------------------------------------------------------- the real frameworks on the embedded model
class CountingMemory(KVMemory):
    """The real facade over the real engine, counting the pieces of text its decodes report (a probe:
    after a consumer went away, at most the piece that was being decoded may follow)."""

    pieces = 0

    def generate(self, ids, *, on_text=None, **kwargs):
        def counted(delta: str) -> None:
            on_text(delta)
            if delta:
                self.pieces += 1

        return super().generate(ids, on_text=counted if on_text else None, **kwargs)


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    shared = borrow_memory(None, None, tmp_path_factory.mktemp("adapters") / "store").memory
    return CountingMemory(engine=shared.engine, router=shared.router)


class _Stopped:
    """`mark()` when the consumer goes away; `check()` then asserts that the decode stopped (its worker
    ended, at most the piece being decoded followed) and freed the memory's lock."""

    def __init__(self, memory: CountingMemory):
        self.memory, self.at_close = memory, None

    def mark(self) -> None:
        self.at_close = self.memory.pieces

    def check(self) -> None:
        assert _workers_gone(STOP_WITHIN_S), "the decode went on after its consumer stopped"
        assert self.memory.pieces - self.at_close <= 1, "the decode went on after its consumer stopped"
        lock = memory_lock(self.memory)
        assert lock.acquire(timeout=0.5), "the memory's lock is still held"
        lock.release()


COUNT = "Count from 1 to 1000, separated by commas."


def _user(text: str):
    from llama_index.core.base.llms.types import ChatMessage, MessageRole

    return [ChatMessage(role=MessageRole.USER, content=text)]


def test_langchain_stream_closed_early_stops_decoding(memory):
    from langchain_kvmemory import ChatKVGraft

    llm = ChatKVGraft(memory=memory, max_tokens=LONG, route=False)
    stream, stopped = llm.stream(COUNT), _Stopped(memory)
    assert next(stream).content
    stopped.mark()
    stream.close()
    stopped.check()
    # The memory is free for the next call.
    assert llm.invoke("Say yes.", max_tokens=2).usage_metadata["output_tokens"] <= 2


def test_langchain_astream_cancelled_stops_decoding(memory):
    from langchain_kvmemory import ChatKVGraft

    llm = ChatKVGraft(memory=memory, max_tokens=LONG, route=False)
    stopped = _Stopped(memory)

    async def open_stream():
        return llm.astream(COUNT)

    _cancel_after_first_chunk(open_stream, stopped.mark)
    stopped.check()


def test_llama_index_stream_chat_closed_early_stops_decoding(memory):
    from llama_index.llms.kvgraft import KVGraftLLM

    llm = KVGraftLLM(memory=memory, max_new_tokens=LONG, route=False)
    gen, stopped = llm.stream_chat(_user(COUNT)), _Stopped(memory)
    assert next(gen).delta
    stopped.mark()
    gen.close()
    stopped.check()
    assert llm.last_answer is None  # the decode was stopped, not finished


def test_llama_index_astream_chat_cancelled_stops_decoding(memory):
    from llama_index.llms.kvgraft import KVGraftLLM

    llm = KVGraftLLM(memory=memory, max_new_tokens=LONG, route=False)
    stopped = _Stopped(memory)
    _cancel_after_first_chunk(lambda: llm.astream_chat(_user(COUNT)), stopped.mark)
    stopped.check()
    assert llm.last_answer is None


def test_run_chat_decodes_what_the_facade_decodes(memory):
    turns = to_turns([Message("user", "Name three colours of the rainbow.")])
    shared = borrow_memory(memory)
    out = run_chat(shared, ChatRequest(turns=turns, max_tokens=12, route=False))
    ans = memory.chat(turns, route=False, max_new_tokens=12)
    assert out.text == ans.text and out.stats.tokens_decoded == ans.report.tokens_decoded
    assert out.stats.prompt_tokens == ans.report.tokens_total


def test_a_system_prompt_is_stored_by_the_first_call_and_grafted_by_the_next(memory):
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer in one short sentence." for i in range(12))
    shared = borrow_memory(memory)

    def call(question: str):
        turns = to_turns([Message("system", system), Message("user", question)])
        return run_chat(shared, ChatRequest(turns=turns, max_tokens=4, route=False))

    first = call("What colour is the sky?")
    assert first.stats.prompt_grafted == 0 and first.stats.blocks_stored > 0
    second = call("What colour is grass?")
    prompt = memory.chat_prompt(to_turns([Message("system", system), Message("user", "What colour is grass?")]),
                                route=False)
    # the whole system segment, up to its cut (memory/layout.py), not only its whole chunks
    assert second.stats.prompt_grafted == prompt.cuts[0] > memory.engine.chunk
    assert memory.engine.stored_prefix_tokens(prompt.ids, cuts=prompt.cuts) == second.stats.prompt_grafted


def test_guided_passes_check_the_stream_before_they_compute(memory):
    """Forced tool calls and structured output stream no text; their passes still stop once the
    stream's consumer went away (the check raises before any forward)."""
    from kvmemory import GREEDY, Decoder, JsonGuide

    def gone(_delta: str) -> None:
        raise StreamCancelled("the consumer went away")

    ids = memory.chat_prompt(to_turns([Message("user", "Is the sky blue?")]), route=False).ids
    dec = Decoder(memory, ids, GREEDY, on_text=gone)
    with pytest.raises(StreamCancelled):
        dec.choose("", ["yes", "no"])
    with pytest.raises(StreamCancelled):
        dec.free("", max_new_tokens=3)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    with pytest.raises(StreamCancelled):
        JsonGuide(dec, "", schema, 8).value(schema)
    assert dec.stats.passes == 0


# ---------------------------------------------------------------------- token counts (adapters/tokens.py)
def test_token_counts_are_what_the_engine_reads(memory):
    """`count_chat_tokens` equals the ids a chat call decodes from when it routes nothing (tools and a
    response schema described in the system turn as `run_chat` describes them), with the tokenizer
    read on its own (no weights) as with the engine's."""
    from kvmemory import chat_token_ids, count_tokens, tokenizer_for
    from kvmemory.adapters.messages import schema_prompt, tools_prompt

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    own = tokenizer_for(None)
    assert own is tokenizer_for("embedded") and own is not memory.engine.tokenizer  # cached per model, read apart
    for turns in (to_turns([Message("user", "Hi")]),
                  to_turns([Message("system", "Be brief."), Message("user", "What is 2 + 2?"),
                            Message("assistant", "4"), Message("user", "And 3 + 3?")])):
        for kw, extra in (({}, ()), ({"tools": tools}, (tools_prompt(tools),)),
                          ({"response_schema": schema}, (schema_prompt(schema),))):
            expected = memory.chat_prompt(with_instructions(turns, *extra), route=False).ids
            assert chat_token_ids(None, turns, **kw) == expected
            assert chat_token_ids(memory.engine.tokenizer, turns, **kw) == expected
    for text in ("Hello world", "12 * 8 = 96", "émigré 東京", ""):
        assert count_tokens(None, text) == len(memory.engine.encode(text)) if text else count_tokens(None, text) == 0


def test_token_counts_refuse_what_they_cannot_read():
    from kvmemory import InvalidInput, UnknownModel, count_chat_tokens, count_tokens

    t0 = time.perf_counter()
    with pytest.raises(UnknownModel, match="no-such-model"):  # the loader's own check (resolve_model_path)
        count_tokens("no-such-org/no-such-model-kvmemory", "hi")
    assert time.perf_counter() - t0 < 10  # no retries against the hub
    with pytest.raises(InvalidInput):
        count_tokens(None, None)
    with pytest.raises(InvalidInput):
        count_chat_tokens(None, "not a list of turns")
    assert count_chat_tokens(None, []) == 0


def test_unknown_option_is_both_typed_and_a_type_error():
    from kvmemory import InvalidInput, UnknownOption

    assert issubclass(UnknownOption, InvalidInput) and issubclass(UnknownOption, TypeError)


def test_scored_tool_policy_measures_the_shift_against_a_content_free_turn(memory):
    """`wants_tool` scores each tool's call against the same prompt with a content-free user turn; the
    content-free scores are computed once per prompt and counted in the call's cost."""
    from kvmemory import GREEDY, Decoder
    from kvmemory.adapters import chat
    from kvmemory.adapters.messages import tools_prompt

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    chat._BASELINES.clear()
    picks = {}
    for q in ("What's the weather like in Paris right now?", "Write a haiku about spring."):
        turns = with_instructions(to_turns([Message("user", q)]), tools_prompt(tools))
        dec = Decoder(memory, memory.chat_prompt(turns, route=False).ids, GREEDY)
        picks[q] = chat.wants_tool(dec, turns, ["get_weather"])
        assert dec.stats.passes == (2 if len(picks) == 1 else 1)  # the baseline's pass only the first time
    assert len(chat._BASELINES) == 1
    assert picks == {"What's the weather like in Paris right now?": "get_weather", "Write a haiku about spring.": None}


def test_no_tool_fits_and_the_model_answers_without_a_call(memory):
    """Issue 48 item 6: a question no bound tool fits (by the router's embedder, `chat.tool_fits`) is
    answered in text, no call; a question a tool fits is still a call to it; what was offered is told."""
    from kvmemory.adapters import chat

    tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": {
        "type": "object", "properties": {p: {"type": "string"}}, "required": [p]}}}
        for n, d, p in (("get_weather", "Get the current weather in a city.", "city"),
                        ("calculator", "Evaluate an arithmetic expression, e.g. 12 * (3 + 4).", "expression"))]
    shared = borrow_memory(memory)
    outs = {}
    for q in ("Who was the first person to walk on the Moon?", "What's the weather like in Madrid today?"):
        outs[q] = run_chat(shared, ChatRequest(turns=to_turns([Message("user", q)]), tools=tools, max_tokens=12,
                                               route=False))
    free = outs["Who was the first person to walk on the Moon?"]
    assert free.tool_calls == [] and free.invalid_tool_calls == [] and free.finish_reason != "tool_calls"
    told = free.provenance()["tool_choice"]
    assert told["offered"] == [] and told["called"] is None
    assert max(told["fit"]["scores"].values()) < told["fit"]["floor"] == chat.TOOL_FIT_FLOORS[chat.MINILM_SHA256]
    weather = outs["What's the weather like in Madrid today?"]
    assert [c["name"] for c in weather.tool_calls] == ["get_weather"]
    assert weather.provenance()["tool_choice"]["offered"] == ["get_weather"]
    assert chat._tool_text(tools[0]["function"]) == "get weather: Get the current weather in a city."
    # The answer is decoded over the conversation without the tool list (which a model that reads it
    # writes a call's JSON from): the same text as the same call with no tools bound.
    plain = run_chat(shared, ChatRequest(turns=to_turns([Message("user", "Who was the first person to walk on the Moon?")]),
                                         max_tokens=12, route=False))
    assert free.text == plain.text and free.stats.prompt_tokens == plain.stats.prompt_tokens
    assert free.stats.passes == plain.stats.passes == 1  # nothing offered: no tool-choice pass
