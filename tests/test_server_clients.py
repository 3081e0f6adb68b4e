"""Off-the-shelf OpenAI clients against a real `kvmemory serve` process, unchanged: the official `openai`
client (chat, streams, tool calls, JSON schema, completions, errors), LangChain's `ChatOpenAI(base_url=...)`
and LlamaIndex's `OpenAILike` (offline: the key is the server's, nothing leaves the machine).

Greedy decoding is deterministic and every graft is exact, so a streamed answer must equal the plain
one word for word even when the second call grafts what the first one stored: the tests compare them.
"""

from __future__ import annotations

import json

import pytest

from server_process import start_server

pytestmark = pytest.mark.slow

KEY = "sk-clients-test-0000"
LONG_Q = ("A school orders 14 boxes of 24 pencils for its classes, gives 100 pencils to the art club and keeps the "
          "rest in the supply room. The supply room already held 30 pencils before the order arrived. "
          "How many pencils are in the supply room now? Explain briefly.")
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression such as 12 * 7.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("clients"), keys={"admin": KEY})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)


# ---------------------------------------------------------------------- openai
def test_openai_chat_stream_equals_plain_and_second_turn_reads_the_cache(client):
    msgs = [{"role": "user", "content": LONG_Q}]
    plain = client.chat.completions.create(model="kvmemory", messages=msgs, max_tokens=24)
    text = plain.choices[0].message.content
    assert text and plain.choices[0].finish_reason in ("stop", "length")
    n1 = plain.usage.prompt_tokens
    assert n1 >= 64 and plain.usage.prompt_tokens_details.cached_tokens == 0
    assert plain.model_extra["kvmemory"]["tokens_computed"] == n1

    chunks = list(client.chat.completions.create(model="kvmemory", messages=msgs, max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # the same greedy answer, though this call grafted the blocks the first one stored
    usage = [c.usage for c in chunks if c.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens == (n1 // 64) * 64 > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [plain.choices[0].finish_reason]

    turn2 = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": "Show the subtraction."}]
    second = client.chat.completions.create(model="kvmemory", messages=turn2, max_tokens=8)
    assert second.usage.prompt_tokens_details.cached_tokens >= (n1 // 64) * 64
    assert second.model_extra["kvmemory"]["tokens_computed"] == second.usage.prompt_tokens - \
        second.usage.prompt_tokens_details.cached_tokens


def test_openai_routes_to_verified_memory_through_extra_body(client, server):
    with server.client(KEY) as c:
        e = c.post("/v1/memory/remember", json={"user_id": "dana", "problem": "Tom has 3 boxes of 12 eggs and "
                   "breaks 5. How many are left?", "solution": "3 * 12 = 36. 36 - 5 = 31. The answer is 31.",
                   "answer": "31"}).json()
    q = [{"role": "user", "content": "Tom owns 3 boxes with 12 eggs each; 5 break. How many eggs remain?"}]
    r = client.chat.completions.create(model="kvmemory", messages=q, max_tokens=12,
                                       extra_body={"kvmemory": {"user_id": "dana"}})
    kvm = r.model_extra["kvmemory"]
    assert [x["id"] for x in kvm["entries"]] == [e["id"]] and kvm["attestation_ids"] == [e["attestation_id"]]
    assert r.usage.prompt_tokens_details.cached_tokens >= 64
    off = client.chat.completions.create(model="kvmemory", messages=q, max_tokens=2,
                                         extra_body={"kvmemory": {"user_id": "dana", "memory": False}})
    assert off.model_extra["kvmemory"]["entries"] == []
    other = client.chat.completions.create(model="kvmemory", messages=q, max_tokens=2,
                                           extra_headers={"X-KVMemory-User-Id": "erin"})
    assert other.model_extra["kvmemory"]["entries"] == [] and other.model_extra["kvmemory"]["namespace"] == "user:erin"


def test_openai_tool_calls_plain_and_streamed(client):
    msgs = [{"role": "user", "content": "What is 1234 * 56? Use the calculator."}]
    r = client.chat.completions.create(model="kvmemory", messages=msgs, tools=[CALCULATOR], tool_choice="required",
                                       max_tokens=32)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "calculator" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"expression"} and isinstance(args["expression"], str) and args["expression"]
    # the tool's result goes back; with tool_choice none the model answers in text
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "69104"}]
    r2 = client.chat.completions.create(model="kvmemory", messages=follow, tools=[CALCULATOR], tool_choice="none",
                                        max_tokens=24)
    assert r2.choices[0].finish_reason in ("stop", "length") and r2.choices[0].message.content
    assert not r2.choices[0].message.tool_calls
    stream = client.chat.completions.create(model="kvmemory", messages=msgs, tools=[CALCULATOR],
                                            tool_choice={"type": "function", "function": {"name": "calculator"}},
                                            max_tokens=32, stream=True)
    deltas = [d for c in stream if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name == "calculator"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == args  # greedy: the same call


def test_openai_json_schema_through_the_guided_decoder(client):
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    msgs = [{"role": "user", "content": "Ann is 31 years old. Give her name and age."}]
    parsed = client.chat.completions.parse(model="kvmemory", messages=msgs, response_format=Person, max_tokens=32)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and person.name.strip() and isinstance(person.age, int)
    raw = client.chat.completions.create(model="kvmemory", messages=msgs, max_tokens=32, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema()}})
    assert Person.model_validate_json(raw.choices[0].message.content) == person


def test_openai_tool_call_by_default_with_tool_choice_auto(client):
    # The default tool policy ("scored", as in the LangChain and LlamaIndex integrations) lets the
    # embedded model call a bound tool without tool_choice="required".
    msgs = [{"role": "user", "content": "What is 1234 * 56? Use the calculator."}]
    r = client.chat.completions.create(model="kvmemory", messages=msgs, tools=[CALCULATOR], max_tokens=32)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    call = choice.message.tool_calls[0]
    assert call.function.name == "calculator"
    assert isinstance(json.loads(call.function.arguments)["expression"], str)


JAPANESE_Q = "How do you say thank you in Japanese? Answer in Japanese only."


def test_a_streamed_japanese_answer_equals_the_plain_one(client):
    # The embedded model's byte-level tokenizer splits many Japanese characters across two tokens; a
    # stream must hold the first half back rather than send U+FFFD it can never take back.
    msgs = [{"role": "user", "content": JAPANESE_Q}]
    text = client.chat.completions.create(model="kvmemory", messages=msgs, max_tokens=24).choices[0].message.content
    assert any(ord(ch) > 0x3000 for ch in text)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="kvmemory", messages=msgs, max_tokens=24, stream=True) if c.choices)
    assert streamed == text
    prompt = "Thank you in Japanese is"
    plain = client.completions.create(model="kvmemory", prompt=prompt, max_tokens=16).choices[0].text
    raw = "".join(ch.choices[0].text for ch in client.completions.create(
        model="kvmemory", prompt=prompt, max_tokens=16, stream=True))
    assert raw == plain


def test_openai_completions_models_and_errors(client, server):
    import openai

    # the served name and the loaded model's id, the same list an unknown model's 404 gives
    assert [m.id for m in client.models.list().data] == ["kvmemory", "embedded:smollm2-135m-instruct"]
    c = client.completions.create(model="kvmemory", prompt="The capital of France is", max_tokens=6)
    assert c.choices[0].text and c.usage.completion_tokens >= 1
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="kvmemory", prompt="The capital of France is", max_tokens=6, stream=True))
    assert streamed == c.choices[0].text
    bad_key = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-nope-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="kvmemory", messages=[{"role": "user", "content": "hi"}], max_tokens=10**6)
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------------- LangChain
def test_langchain_chat_openai(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    llm = ChatOpenAI(model="kvmemory", base_url=f"{server.url}/v1", api_key=KEY, max_tokens=24, temperature=0,
                     max_retries=0)
    msg = llm.invoke(LONG_Q)
    assert msg.content and msg.usage_metadata["input_tokens"] >= 64
    again = "".join(chunk.content for chunk in llm.stream(LONG_Q))
    assert again == msg.content
    second = llm.invoke([("human", LONG_Q), ("ai", msg.content), ("human", "Show the subtraction.")])
    assert second.usage_metadata["input_token_details"]["cache_read"] >= 64

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression such as 12 * 7."""
        return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 (digits and operators only, in a test)

    called = llm.bind_tools([calculator], tool_choice="calculator").invoke("What is 12 * 7? Use the calculator.")
    assert called.tool_calls and called.tool_calls[0]["name"] == "calculator"
    assert isinstance(called.tool_calls[0]["args"]["expression"], str)

    class Person(BaseModel):
        name: str
        age: int

    person = llm.with_structured_output(Person, method="json_schema").invoke("Ann is 31 years old. Who is she?")
    assert isinstance(person, Person) and person.name.strip()


# ---------------------------------------------------------------------- LlamaIndex
def test_llamaindex_openai_like(server):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model="kvmemory", api_base=f"{server.url}/v1", api_key=KEY, is_chat_model=True,
                     context_window=8192, max_tokens=24, temperature=0.0, max_retries=0)
    msgs = [ChatMessage(role="user", content=LONG_Q)]
    resp = llm.chat(msgs)
    assert resp.message.content
    streamed = "".join(r.delta or "" for r in llm.stream_chat(msgs))
    assert streamed == resp.message.content
    completer = OpenAILike(model="kvmemory", api_base=f"{server.url}/v1", api_key=KEY, is_chat_model=False,
                           context_window=8192, max_tokens=6, temperature=0.0, max_retries=0)
    done = completer.complete("The capital of France is")
    assert done.text and done.text == "".join(r.delta or "" for r in completer.stream_complete("The capital of France is"))
