"""Facts answered (issue 48 item 3): facts a chat told, asked back, are answered from the notes `add`
wrote (`Answer.source` "note", the note's sentence as the answer); the LangGraph store's `search` sees
every note of its namespace, gated at the calibrated note threshold; the facts bench answers its sets.

Runs on the embedded SmolLM2 and the MiniLM router (the notes' KV is computed and proven)."""

from __future__ import annotations

import pytest

from kvmemory.errors import InvalidInput

CHAT = [{"role": "user", "content": "My dog is called Rex. I work as a dentist in Porto. My favourite colour is green."},
        {"role": "assistant", "content": "Noted!"}]
ASKED = [("What is my dog's name?", "My dog is called Rex."),
         ("Which city do I work in?", "I work as a dentist in Porto."),
         ("What is my favourite colour?", "My favourite colour is green.")]
UNRELATED = ["What is the capital of Australia?", "How do I bake sourdough bread?", "Explain how a transistor works."]


# ---------------------------------------------------------------------------------------------- item 1
def test_a_question_routed_to_a_note_is_answered_with_its_fact(real_memory):
    mem = real_memory
    kept = mem.add(CHAT)
    by_text = {n.problem: n.id for n in kept.notes}
    for question, fact in ASKED:
        ans = mem.answer(question, max_new_tokens=8)
        assert (ans.text, ans.source, ans.kinds, ans.entries) == (fact, "note", ["note"], [by_text[fact]])
        assert ans.outcome == "note_statement" and ans.to_json()["source"] == "note"
    for question in UNRELATED:
        assert mem.route(question) == []
    # The opt-out: the model decodes from the grafted note, as before.
    decoded = mem.answer(ASKED[0][0], max_new_tokens=2, note_answer="decode")
    assert decoded.outcome is None and decoded.source == "note" and decoded.report.tokens_grafted > 0
    with pytest.raises(InvalidInput):
        mem.answer(ASKED[0][0], note_answer="guess")


def test_a_note_of_several_sentences_answers_with_the_nearest_one(real_memory):
    mem = real_memory
    note = mem.note("My dog is called Rex. I work as a dentist in Porto.", namespace="long")
    # A statement of two facts scores lower against a question about one: routed here with a threshold
    # given (the sentence chosen is what is tested).
    ans = mem.answer("Which city do I work in?", namespace="long", threshold=0.1)
    assert (ans.text, ans.entries, ans.source) == ("I work as a dentist in Porto.", [note.id], "note")
    streamed: list[str] = []
    mem.answer("What is my dog's name?", namespace="long", threshold=0.1, on_text=streamed.append)
    assert streamed == ["My dog is called Rex."]


# ---------------------------------------------------------------------------------------------- item 2
def test_the_langgraph_store_sees_every_note_at_the_calibrated_threshold(real_memory):
    langchain_kvmemory = pytest.importorskip("langchain_kvmemory")
    mem = real_memory
    kept = mem.add(CHAT, namespace="users.ana")
    store = langchain_kvmemory.KVMemoryStore(memory=mem, index_fields=["text"])
    store.put(("users", "ana"), "pet", {"text": "Ana has a grey cat called Miso."})
    store.flush()
    dog = next(n for n in kept.notes if n.problem == "My dog is called Rex.")
    hits = store.search(("users", "ana"), query="What is my dog's name?", limit=3)
    assert (hits[0].namespace, hits[0].key) == (("users", "ana"), dog.id)
    assert hits[0].value == {"text": "My dog is called Rex.", "kind": "note", "entry_id": dog.id}
    assert [h.key for h in store.search(("users",), query="What pet does Ana have?", limit=1)] == ["pet"]
    for question in UNRELATED:
        assert store.search(("users",), query=question, limit=5) == []
    # Listed too (no query), with the items put here; other prefixes do not see them.
    listed = {h.key for h in store.search(("users", "ana"), limit=20)}
    assert listed == {"pet", *(n.id for n in kept.notes)}
    assert store.search(("other",), query="What is my dog's name?") == []
    # threshold=None: every indexed item ranked, as LangGraph's InMemoryStore ranks.
    ranked = langchain_kvmemory.KVMemoryStore(memory=mem, index_fields=["text"], threshold=None)
    assert len(ranked.search(("users",), query=UNRELATED[0], limit=10)) == 4
    with pytest.raises(InvalidInput):
        langchain_kvmemory.KVMemoryStore(memory=mem, threshold="loose")


# ---------------------------------------------------------------------------------------------- item 3
def test_the_facts_bench_answers_what_its_chats_told(real_memory):
    from kvmemory.bench import facts

    sets = facts.load()
    assert set(sets) == {"tuning", "report", "heldout"}
    for data in sets.values():
        assert data["chats"] and data["unrelated"]
        assert all(len(q) == 2 and q[1] for c in data["chats"] for q in c["questions"])
    data = {"chats": sets["heldout"]["chats"][:2], "unrelated": sets["heldout"]["unrelated"][:4]}
    res = facts.run_set(real_memory, data, prefix="t")
    assert res["facts_right"] == res["facts_asked"] == 7 and res["misses"] == []
    assert (res["unrelated_asked"], res["unrelated_routed_to_a_note"]) == (8, 0)
    with pytest.raises(InvalidInput):
        facts.load("other")
