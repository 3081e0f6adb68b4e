"""Batch remember over HTTP (`POST /v1/memory/remember` with a list) and MCP (`remember` with `items`),
against a real `kvmemory serve` process over a tiny random Llama (the bytes and the fates are tested,
not the answers): each item's fate in order, a refused item refused alone, one scope for the batch, the
single form unchanged."""

from __future__ import annotations

import asyncio
import json

import pytest
from server_process import start_server
from tiny_models import save_tiny_llama

ALICE = "sk-alice-batch-1111"
BOB = "sk-bob-batch-22222"
KEYS_FILE = {"keys": [{"name": "alice", "key": ALICE, "user_ids": ["alice"]},
                      {"name": "bob", "key": BOB, "user_ids": ["bob"]}]}


def _item(n: int, **kw) -> dict:
    return {"problem": f"A box holds {n} eggs and {n + 1} more are added. How many eggs are in the box?",
            "solution": f"{n} + {n + 1} = {2 * n + 1}. The answer is {2 * n + 1}.", "answer": str(2 * n + 1), **kw}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch")
    srv = start_server(tmp, "--model", save_tiny_llama(tmp), keys_file=KEYS_FILE)
    yield srv
    srv.stop()


def test_http_list_remembers_each_item_and_refuses_alone(server):
    items = [_item(3, metadata={"n": 3}), _item(5, answer="999"), {"problem": "Alice likes green tea."},
             _item(7, aliases=["seven eggs and eight more"])]
    with server.client(ALICE) as a:
        r = a.post("/v1/memory/remember", json={"user_id": "alice", "items": items})
        bare = a.post("/v1/memory/remember", json=[_item(9), _item(11, user_id="alice")])
        mixed = a.post("/v1/memory/remember", json=[_item(13, user_id="alice"), _item(15, user_id="bob")])
        bad_item = a.post("/v1/memory/remember", json={"items": [_item(17, colour="red")]})
        empty = a.post("/v1/memory/remember", json={"items": []})
        single = a.post("/v1/memory/remember", json=_item(19))
        listed = a.get("/v1/memory/entries", params={"limit": 50}).json()
        got = a.get(f"/v1/memory/entries/{r.json()['results'][0]['id']}")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["counts"] == {"items": 4, "remembered": 3, "refused": 1}
    res = out["results"]
    assert [x["index"] for x in res] == [0, 1, 2, 3]
    assert [x["status"] for x in res] == ["remembered", "refused", "remembered", "remembered"]
    assert res[1]["http_status"] == 422 and res[1]["error"]["code"] == "verification_failed"
    assert res[0]["metadata"] == {"n": 3} and res[0]["bit_identical"] is True and res[2]["kind"] == "note"
    assert res[3]["aliases"] == ["seven eggs and eight more"]
    assert got.status_code == 200 and got.json()["id"] == res[0]["id"]
    # the bare array: its items name one scope (or none); two scopes in one call are a 400
    assert bare.status_code == 200, bare.text
    assert [x["status"] for x in bare.json()["results"]] == ["remembered"] * 2
    assert mixed.status_code == 400 and "one scope" in mixed.json()["error"]["message"]
    assert bad_item.status_code == 400 and "colour" in bad_item.json()["error"]["message"]
    assert empty.status_code == 400
    # the single form is unchanged: the entry itself, not a list
    assert single.status_code == 200 and "results" not in single.json() and single.json()["problem"] == _item(19)["problem"]
    ids = {e["id"] for e in listed["data"]}
    assert {x["id"] for x in res if x["status"] == "remembered"} <= ids
    assert len(ids) == 3 + 2 + 1


def test_http_list_stays_in_the_callers_scope(server):
    with server.client(BOB) as b:
        denied = b.post("/v1/memory/remember", json={"user_id": "alice", "items": [_item(21)]})
        own = b.post("/v1/memory/remember", json={"items": [_item(21)]})
    assert denied.status_code == 403
    assert own.status_code == 200 and own.json()["results"][0]["scope"]["user_id"] == "bob"


async def _mcp(server, key: str, calls):
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    async with create_mcp_http_client(headers={"Authorization": f"Bearer {key}"}) as http:
        async with Client(streamable_http_client(f"{server.url}/mcp", http_client=http)) as c:
            return [await c.call_tool(name, args) for name, args in calls]


def test_mcp_remember_takes_a_list(server):
    many, one, both = asyncio.run(_mcp(server, ALICE, [
        ("remember", {"items": [_item(31), _item(33, answer="1"), {"problem": "x", "colour": "red"}]}),
        ("remember", _item(35)),
        ("remember", {"problem": "p", "items": [_item(37)]}),
    ]))
    assert not many.is_error, many.content[0].text
    out = json.loads(many.content[0].text)
    assert [x["status"] for x in out["results"]] == ["remembered", "refused", "refused"]
    assert out["results"][1]["error"]["code"] == "verification_failed"
    assert "colour" in out["results"][2]["error"]["message"]
    assert not one.is_error and json.loads(one.content[0].text)["problem"] == _item(35)["problem"]
    assert both.is_error
