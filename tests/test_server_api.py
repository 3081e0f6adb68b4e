"""One API everywhere, over HTTP and MCP, against a real `kvmemory serve` process: an entry's update
(PATCH) and history (GET .../history) with the Python API's semantics, `where` on /recall and
/answer, MCP tools for get / list / update / history, the MCP server's version and readable refusals
of a wrong key, `response_format: json_object` (the `openai` client and LangChain's json_mode), and
the same model ids in `/v1/models` and in the 404 for another id.

One server for the module (the model loads once).
"""

from __future__ import annotations

import asyncio
import json
from importlib.metadata import version

import httpx
import pytest

from server_process import start_server

pytestmark = pytest.mark.slow

ADMIN = "sk-admin-api-0000"
ALICE = "sk-alice-api-1111"
BOB = "sk-bob-api-22222"
KEYS_FILE = {"keys": [{"name": "alice", "key": ALICE, "user_ids": ["alice"]},
                      {"name": "bob", "key": BOB, "user_ids": ["bob"]}]}
SERVED = "smol-served"
EGGS = {"problem": "Tom has 3 boxes of 12 eggs and breaks 5. How many are left?",
        "solution": "3 * 12 = 36. 36 - 5 = 31. The answer is 31.", "answer": "31"}
HENS = {"problem": "Tom has 3 cartons of 12 eggs and drops 5 of them. How many eggs are left?",
        "solution": "3 cartons of 12 is 36 eggs. 36 - 5 = 31. The answer is 31.", "answer": "31"}
EGGS_Q = "Tom owns 3 boxes with 12 eggs each; 5 break. How many eggs remain?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("api"), "--served-model-name", SERVED, keys={"admin": ADMIN},
                       keys_file=KEYS_FILE)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def entries(server):
    """Two of Alice's entries on the same question, told apart by their metadata."""
    with server.client(ALICE) as a:
        eggs = a.post("/v1/memory/remember", json={**EGGS, "metadata": {"topic": "eggs", "n": 1}})
        hens = a.post("/v1/memory/remember", json={**HENS, "metadata": {"topic": "hens", "n": 2}})
    assert eggs.status_code == 200, eggs.text
    assert hens.status_code == 200, hens.text
    return eggs.json(), hens.json()


# ---------------------------------------------------------------------- models
def test_models_lists_every_id_the_404_lists_and_each_is_served(server):
    with server.client(ADMIN) as c:
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        missing = c.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi", "max_tokens": 1})
        served = {mid: c.post("/v1/completions", json={"model": mid, "prompt": "Hello", "max_tokens": 1}).status_code
                  for mid in ids}
    assert ids[0] == SERVED and set(ids) == {SERVED, "kvmemory", "embedded:smollm2-135m-instruct"}
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert f"GET /v1/models lists {ids}" in missing.json()["error"]["message"]  # the same ids, the same order
    assert served == dict.fromkeys(ids, 200)


# ---------------------------------------------------------------------- update and history over HTTP
def test_patch_updates_an_entry_and_history_keeps_every_version(server, entries):
    eggs, _ = entries
    eid = eggs["id"]
    assert eggs["version"] == 1
    with server.client(ALICE) as a, server.client(BOB) as b:
        meta = a.patch(f"/v1/memory/entries/{eid}", json={"metadata": {"topic": "food", "n": None, "shelf": 2}})
        assert meta.status_code == 200, meta.text
        m = meta.json()
        assert m["id"] == eid and m["version"] == 2 and m["metadata"] == {"topic": "food", "shelf": 2}
        assert m["attestation_id"] == eggs["attestation_id"]  # metadata changes no KV
        # new texts: verified again, computed and proven, a new attestation
        new_solution = "Eggs: 3 * 12 = 36. Broken: 5. 36 - 5 = 31. The answer is 31."
        texts = a.patch(f"/v1/memory/entries/{eid}", json={"solution": new_solution, "aliases": ["Tom's eggs left?"]})
        assert texts.status_code == 200, texts.text
        t = texts.json()
        assert t["version"] == 3 and t["solution"] == new_solution and t["verified"]
        assert t["attestation"]["bit_identical"] and t["attestation_id"] != eggs["attestation_id"]
        assert t["aliases"] == ["Tom's eggs left?"] and t["metadata"] == {"topic": "food", "shelf": 2}
        # a solution the verifier refuses: 422, nothing changes
        refused = a.patch(f"/v1/memory/entries/{eid}", json={"answer": 32})
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "verification_failed"
        assert a.get(f"/v1/memory/entries/{eid}").json()["version"] == 3

        hist = a.get(f"/v1/memory/entries/{eid}/history")
        assert hist.status_code == 200, hist.text
        h = hist.json()
        assert h["id"] == eid and h["namespace"] == "user:alice"
        assert [v["version"] for v in h["versions"]] == [1, 2, 3]
        assert [v["solution"] for v in h["versions"]] == [EGGS["solution"], EGGS["solution"], new_solution]
        assert h["versions"][0]["meta"] == {"topic": "eggs", "n": 1} and h["versions"][-1]["replaced"] is None
        assert set(h["versions"][0]) == {"version", "problem", "solution", "answer", "verified", "meta", "aliases",
                                         "chain", "attestation_id", "updated", "replaced"}  # EntryVersion.to_json

        # bad input: 400 naming it; an unknown id, or another tenant's: the same 404
        assert a.patch(f"/v1/memory/entries/{eid}", json={}).status_code == 400
        bad = a.patch(f"/v1/memory/entries/{eid}", json={"solutoin": "x"})
        assert bad.status_code == 400 and "solutoin" in bad.json()["error"]["message"]
        bad_meta = a.patch(f"/v1/memory/entries/{eid}", json={"metadata": {"aliases": ["x"]}})
        assert bad_meta.status_code == 400, bad_meta.text
        for client, path in ((a, "/v1/memory/entries/0123456789abcdef"), (b, f"/v1/memory/entries/{eid}")):
            r = client.patch(path, json={"metadata": {"x": 1}})
            assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_entry", r.text
            assert "user:alice" not in r.text or client is a  # Bob learns nothing of Alice's namespace
            assert client.get(path + "/history").status_code == 404
        assert a.get(f"/v1/memory/entries/{eid}/history").json()["versions"][-1]["version"] == 3  # Bob changed nothing


def test_recall_and_answer_take_where(server, entries):
    eggs, hens = entries
    with server.client(ALICE) as a:
        both = a.post("/v1/memory/recall", json={"query": EGGS_Q, "k": 5})
        hens_only = a.post("/v1/memory/recall", json={"query": EGGS_Q, "k": 5, "where": {"topic": "hens"}})
        by_op = a.post("/v1/memory/recall", json={"query": EGGS_Q, "k": 5, "where": {"n": {"$gte": 2}}})
        bad = a.post("/v1/memory/recall", json={"query": EGGS_Q, "where": {"n": {"$bigger": 2}}})
        answered = a.post("/v1/memory/answer", json={"query": EGGS_Q, "where": {"topic": "hens"}, "max_tokens": 4})
        listed = a.get("/v1/memory/entries", params={"metadata": json.dumps({"n": {"$gte": 2}})})
    assert both.status_code == 200, both.text
    assert {r["id"] for r in both.json()["results"]} == {eggs["id"], hens["id"]}
    assert [r["id"] for r in hens_only.json()["results"]] == [hens["id"]]
    assert [r["id"] for r in by_op.json()["results"]] == [hens["id"]]
    assert bad.status_code == 400 and "$bigger" in bad.json()["error"]["message"]
    assert answered.status_code == 200, answered.text
    assert answered.json()["entries"] == [hens["id"]]
    assert [e["id"] for e in listed.json()["data"]] == [hens["id"]]


# ---------------------------------------------------------------------- MCP
async def _mcp(server, key: str | None, calls):
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with create_mcp_http_client(headers=headers) as http:
        async with Client(streamable_http_client(f"{server.url}/mcp", http_client=http)) as c:
            names = sorted(t.name for t in (await c.list_tools()).tools)
            return c.server_info, names, [await c.call_tool(name, args) for name, args in calls]


def test_mcp_reads_updates_and_lists_entries_like_http(server, entries):
    _, hens = entries
    hid = hens["id"]
    with server.client(ALICE) as a:
        http_entry = a.get(f"/v1/memory/entries/{hid}").json()
    info, names, (got, listed, updated, hist, missing, crossed) = asyncio.run(_mcp(server, ALICE, [
        ("get", {"entry_id": hid}),
        ("list", {"where": {"topic": "hens"}}),
        ("update", {"entry_id": hid, "metadata": {"checked": True}}),
        ("history", {"entry_id": hid}),
        ("get", {"entry_id": "0123456789abcdef"}),
        ("list", {"user_id": "bob"}),
    ]))
    assert info.name == "kvmemory" and info.version == version("kvmemory")
    assert {"get", "list", "update", "history"} <= set(names)
    assert not got.is_error and json.loads(got.content[0].text) == http_entry  # the same JSON as the HTTP route
    with server.client(ALICE) as a:
        http_hist = a.get(f"/v1/memory/entries/{hid}/history").json()
    assert [e["id"] for e in json.loads(listed.content[0].text)["data"]] == [hid]
    u = json.loads(updated.content[0].text)
    assert not updated.is_error and u["version"] == 2 and u["metadata"] == {"topic": "hens", "n": 2, "checked": True}
    assert json.loads(hist.content[0].text) == http_hist  # the same JSON as the HTTP route
    assert missing.is_error and "UnknownEntry" in missing.content[0].text
    assert crossed.is_error and "Forbidden" in crossed.content[0].text


def _mcp_errors(exc: BaseException) -> list[str]:
    """The messages of the MCPErrors in what the SDK's client raised (anyio wraps them in groups)."""
    from mcp.shared.exceptions import MCPError

    out, todo, seen = [], [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, MCPError):
            out.append(str(e))
        todo += [*getattr(e, "exceptions", ()), e.__cause__, e.__context__]
    return out


def test_a_wrong_or_missing_key_reaches_the_mcp_client_with_its_cause(server):
    for key, cause in (("sk-not-a-key-000", "invalid API key"), (None, "missing API key")):
        with pytest.raises(BaseException) as info:
            asyncio.run(_mcp(server, key, []))
        messages = _mcp_errors(info.value)
        assert messages and all(cause in m for m in messages), messages  # not "Server returned an error response"
    # plain HTTP clients still read an OpenAI-style type, and the JSON-RPC error's data
    r = httpx.post(f"{server.url}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                   headers={"Authorization": "Bearer sk-not-a-key-000"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.json()["error"]["data"]["code"] == "invalid_api_key"


# ---------------------------------------------------------------------- json_object
def test_response_format_json_object_with_openai_and_langchain_json_mode(server):
    import openai
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=ADMIN, max_retries=0, timeout=300)
    q = "Ann is 31 years old. Who is she? Return name and age as JSON."
    raw = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": q}], max_tokens=32,
                                         response_format={"type": "json_object"})
    value = json.loads(raw.choices[0].message.content)
    assert isinstance(value, dict) and value and raw.choices[0].finish_reason == "stop"

    class Person(BaseModel):
        name: str
        age: int

    llm = ChatOpenAI(model=SERVED, base_url=f"{server.url}/v1", api_key=ADMIN, max_tokens=32, temperature=0,
                     max_retries=0)
    person = llm.with_structured_output(Person, method="json_mode").invoke(q)
    assert isinstance(person, Person) and person.name == "Ann" and person.age == 31


# ---------------------------------------------------------------------- notes
def test_a_note_is_remembered_and_found_over_http_and_mcp(server):
    """A statement remembered without a solution is a note, over MCP as over HTTP; a question about it
    scores below the solutions' threshold and is found at the notes' own (memory/notes.py)."""
    with server.client(BOB) as b:
        http_note = b.post("/v1/memory/remember", json={"problem": "Bob's sister is called Ada."})
        found = b.post("/v1/memory/recall", json={"query": "What is the name of Bob's sister?"})
    assert http_note.status_code == 200, http_note.text
    assert http_note.json()["kind"] == "note" and http_note.json()["verified"] is False
    assert [r["id"] for r in found.json()["results"]] == [http_note.json()["id"]]
    assert found.json()["results"][0]["score"] < 0.83
    _, _, (made, got) = asyncio.run(_mcp(server, BOB, [
        ("remember", {"problem": "Bob drinks his coffee black."}),
        ("recall", {"query": "How does Bob take his coffee?"}),
    ]))
    assert not made.is_error, made.content[0].text
    note = json.loads(made.content[0].text)
    assert note["kind"] == "note" and note["verified"] is False
    assert json.loads(got.content[0].text)["results"][0]["id"] == note["id"]


def test_answer_takes_the_prior_over_http(server, entries):
    with server.client(ALICE) as a:
        default = a.post("/v1/memory/answer", json={"query": EGGS_Q, "choices": "numbers",
                                                    "answer_prefix": "The answer is"})
        none = a.post("/v1/memory/answer", json={"query": EGGS_Q, "choices": "numbers", "prior": 0,
                                                 "answer_prefix": "The answer is"})
        bad = a.post("/v1/memory/answer", json={"query": EGGS_Q, "choices": "numbers", "prior": -1})
    assert default.status_code == 200 and none.status_code == 200, (default.text, none.text)
    d, n = default.json(), none.json()
    assert d["choices"] == n["choices"] and "31" in d["choices"]
    i = d["choices"].index("31")
    assert [round(x - y, 3) for x, y in zip(d["choice_scores"], n["choice_scores"])] == \
        [2.5 if j == i else 0.0 for j in range(len(d["choices"]))]
    assert bad.status_code in (400, 422) and "prior" in bad.text
