"""The memory tools: remember_solution verifies before storing (a wrong solution is refused and
reported to the agent), recall_solution returns what was stored with its provenance."""

from __future__ import annotations

from langchain_core.messages import ToolMessage

from langchain_kvmemory import KVMemoryRetriever, create_recall_tool, create_remember_tool
from lc_testutil import fresh_store


def _call(tool, **args) -> ToolMessage:
    return tool.invoke({"type": "tool_call", "id": "t1", "name": tool.name, "args": args})


def test_remember_verifies_then_recall_finds_it():
    store = fresh_store()
    remember = create_remember_tool(store=store, namespace="math")
    recall = create_recall_tool(KVMemoryRetriever(store=store, namespace="math", k=1))
    bad = _call(remember, problem="What is 17 * 23?", solution="17 * 23 = 381. The answer is 381.", answer="381")
    assert bad.status == "error" and "not stored" in bad.content and not bad.artifact
    assert _call(recall, query="What is 17 * 23?").artifact == []
    good = _call(remember, problem="What is 17 * 23?", solution="17 * 23 = 391. The answer is 391.", answer="391")
    assert good.status == "success" and good.artifact["verified"] is True and good.artifact["answer"] == "391"
    found = _call(recall, query="What is 17 times 23?")  # cosine 0.91 with the stored problem
    assert found.artifact[0]["entry_id"] == good.artifact["entry_id"]
    assert found.artifact[0]["attestation_id"] == good.artifact["attestation_id"]
    assert "17 * 23 = 391" in found.content and good.artifact["entry_id"] in found.content
