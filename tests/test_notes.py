"""Facts and notes (issue 41): a statement remembered without a solution is a note (unverified, kind
"note"), stored, proven, listed, routed and grafted like any entry; a refused solution is still refused;
`KVMemory.add(messages)` keeps what a chat taught by a fixed rule.

The extraction rule is pure text (fast tests); storing, routing and grafting run on the embedded SmolLM2."""

from __future__ import annotations

import json

import pytest

from kvmemory.errors import InvalidInput, VerificationFailed
from kvmemory.memory import notes
from kvmemory.memory.verifiers import kind_of

CAT = "Alice has a cat named Tom."
QUESTION = "What pet does Alice have?"


# ---------------------------------------------------------------------------------------------- the rule
def test_facts_are_the_statements_of_a_message():
    text = ("Hi! Remember that Alice likes green tea. I'm vegetarian.\nMy flight leaves on Monday. "
            "Thanks. Ok.")
    assert notes.facts_in(text) == ["Alice likes green tea.", "I'm vegetarian.", "My flight leaves on Monday."]
    assert notes.facts_in("What pet does Alice have? Tell me a joke. Please help me. Can you sing") == []
    assert notes.facts_in("Alice likes tea. Alice likes tea.") == ["Alice likes tea."]
    assert notes.asks("Tell me about Paris.") and notes.asks("Is it raining") and notes.asks("It's late?")
    assert not notes.asks("Paris is in France.")
    assert notes.facts_in("Please remember that Alice likes tea.") == ["Alice likes tea."]
    assert not notes.message_asks("Please remember that Alice likes tea. FYI, Bob is away.")
    assert notes.message_asks("Alice likes tea. What does Bob like?")


# ---------------------------------------------------------------------------------------------- storing
def test_remember_a_statement_stores_a_note(real_memory):
    mem = real_memory
    e = mem.remember(CAT)
    assert (e.problem, e.solution, e.answer, e.verified) == (CAT, "", None, False)
    assert kind_of(e) == "note" and e.verifier["name"] == "note" and e.verifier["ok"] is False
    assert e.attestation["bit_identical"] is True and len(e.chain) >= 1
    assert mem.note(CAT).id == e.id and mem.note(CAT).updated == e.updated  # the same note: not computed again
    page = mem.list().to_json()
    assert [(x["id"], x["kind"], x["verified"], x["problem"]) for x in page["entries"]] == [(e.id, "note", False, CAT)]
    # The HTTP API lists it with its kind, and stores one when a remember carries no solution.
    from kvmemory.server import memory_ops as ops

    assert ops.entry_json(e)["kind"] == "note"
    http = ops.remember(mem, "http", problem="Bob likes coffee.", solution=None)
    assert (http["kind"], http["verified"], http["bit_identical"], http["solution"]) == ("note", False, True, "")
    summary = mem.verify([e.id])
    assert summary.checked == 1 and summary.bit_identical == 1
    # A note is changed as a note: the new statement is proven again and stays one.
    moved = mem.update(e.id, problem="Alice has a cat named Tom and a dog named Rex.")
    assert kind_of(moved) == "note" and moved.verified is False and moved.id == e.id and moved.chain != e.chain


def test_a_refused_solution_is_not_made_a_note(real_memory):
    mem = real_memory
    q = "Oskar has 5 bags of 4 apples. How many apples does he have?"
    with pytest.raises(VerificationFailed, match="wrong arithmetic"):
        mem.remember(q, "5 * 4 = 21. The answer is 21.", "21", verifier="arithmetic")
    with pytest.raises(VerificationFailed):
        mem.remember(q, "5 * 4 = 20. The answer is 20.", "21")  # exact-answer: 20 is not 21
    assert mem.list().total == 0
    # A note has no answer and no verifier: asking for one is a mistake, said so, nothing stored.
    with pytest.raises(InvalidInput, match="no answer"):
        mem.remember(CAT, answer="Tom")
    with pytest.raises(InvalidInput, match="verifier"):
        mem.remember(CAT, verifier="arithmetic")
    with pytest.raises(InvalidInput):
        mem.remember(q, "")  # an empty solution is not "no solution"
    assert mem.list().total == 0
    ok = mem.remember(q, "5 * 4 = 20. The answer is 20.", "20", verifier="arithmetic")
    assert ok.verified and kind_of(ok) == "solution"


def test_add_keeps_what_a_chat_taught(real_memory):
    mem = real_memory
    chat = [
        {"role": "user", "content": "Hi! I live in Lyon. My sister Maya is a nurse."},
        {"role": "assistant", "content": "Nice to meet you."},
        {"role": "user", "content": "Ravi packs 7 crates with 8 jars each. How many jars does he pack?"},
        {"role": "assistant", "content": "7 * 8 = 56. The answer is 56.", "answer": "56"},
        {"role": "user", "content": "Ines reads 9 pages a day for 9 days. How many pages does she read?"},
        {"role": "assistant", "content": "9 * 9 = 80. The answer is 80."},
        {"role": "assistant", "content": "Anything else?"},
        {"role": "user", "content": "I prefer window seats."},
    ]
    got = mem.add(chat)
    assert [e.problem for e in got.notes] == ["I live in Lyon.", "My sister Maya is a nurse.", "I prefer window seats."]
    assert all(kind_of(e) == "note" and not e.verified for e in got.notes)
    assert [(e.problem, e.answer, e.verified) for e in got.solutions] == [(chat[2]["content"], "56", True)]
    assert [(s["problem"], s["solution"]) for s in got.skipped] == [(chat[4]["content"], chat[5]["content"])]
    assert "wrong arithmetic" in got.skipped[0]["reason"]
    # Nothing else was stored: the assistant's words and the refused pair's premises are not facts.
    listed = {x["problem"]: x["kind"] for x in mem.list().to_json()["entries"]}
    assert listed == {"I live in Lyon.": "note", "My sister Maya is a nurse.": "note",
                      "I prefer window seats.": "note", chat[2]["content"]: "solution"}
    json.dumps(got.to_json())
    # The whole chat again: the notes are the same entries, not computed again.
    again = mem.add(chat, pairs=False)
    assert [(e.id, e.updated) for e in again.notes] == [(e.id, e.updated) for e in got.notes]
    assert again.solutions == [] and again.skipped == []
    with pytest.raises(InvalidInput):
        mem.add([{"role": "user"}, "not a message"])
    with pytest.raises(InvalidInput):
        mem.add(chat, namespace="bad\x00namespace")


# ---------------------------------------------------------------------------------------------- routing
def test_a_note_routes_and_is_grafted(real_memory):
    mem = real_memory
    note = mem.note(CAT)
    mem.remember("Tom has 3 boxes of 12 apples. How many apples does he have?",
                 "3 * 12 = 36. The answer is 36.", "36")
    # The question scores below the threshold that routes solutions (a question is not a rewording of
    # a statement): notes are routed at their own threshold, by recall as by answer.
    hits = mem.route(QUESTION)
    assert [h.entry.id for h in mem.recall(QUESTION)] == [note.id]
    assert mem.recall(QUESTION, threshold=0.83) == []
    assert [h.entry.id for h in hits] == [note.id] and 0.54 <= hits[0].score < mem.router.threshold
    # note_answer="decode": the model decodes from the grafted note (by default the note's statement is
    # the answer: tests/test_facts_answered.py)
    ans = mem.answer(QUESTION, max_new_tokens=12, note_answer="decode")
    assert ans.entries == [note.id] and ans.kinds == ["note"] and ans.verified == [False]
    assert ans.report.tokens_grafted == len(note.token_ids) and ans.report.blocks_used == list(note.chain)
    assert "Tom" in ans.text
    assert ans.to_json()["kinds"] == ["note"]
    # What routes to nothing still routes to nothing; a threshold given applies to notes too.
    assert mem.route("What is the capital of France?") == []
    assert mem.route(QUESTION, threshold=0.83) == []
    assert mem.answer("What is the capital of France?", max_new_tokens=1).entries == []
    # Adapters see the kind and the statement.
    assert hits[0].metadata()["kind"] == "note" and hits[0].text() == CAT and hits[0].to_json()["kind"] == "note"
    chat = mem.chat([{"role": "user", "content": QUESTION}], max_new_tokens=1)
    assert chat.entries == [note.id] and chat.kinds == ["note"] and chat.report.tokens_grafted == len(note.token_ids)


def test_cli_list_says_note(real_memory, capsys):
    from kvmemory.cli import main

    note = real_memory.note(CAT)
    store = ["--store", str(real_memory.store.path)]
    assert main(["list", *store, "--json"]) == 0
    page = json.loads(capsys.readouterr().out)
    assert [(e["id"], e["kind"]) for e in page["entries"]] == [(note.id, "note")]
    assert main(["list", *store]) == 0
    assert f"{note.id}  default  v1  [NOTE] {CAT!r}" in capsys.readouterr().out


def test_cli_remember_a_statement(tmp_path, capsys):
    from kvmemory.cli import main
    from tiny_models import save_tiny_llama

    common = ["--model", save_tiny_llama(tmp_path), "--store", str(tmp_path / "store")]
    assert main(["remember", "--problem", "Alice likes green tea.", "--json", *common]) == 0
    got = json.loads(capsys.readouterr().out)["remembered"]
    assert [(o["kind"], o["verified"], o["bit_identical"]) for o in got] == [("note", False, True)]
    assert main(["remember", "--problem", "Bob likes coffee.", *common]) == 0
    assert "blocks, note, graft bit-identical: True" in capsys.readouterr().out
    # --answer / --verifier check a solution: without one they are a mistake, refused before the model loads.
    assert main(["remember", "--problem", "Alice likes green tea.", "--answer", "tea", "--json", *common]) == 2
    assert json.loads(capsys.readouterr().out)["error"] == "InvalidInput"
    assert main(["list", "--store", str(tmp_path / "store"), "--json"]) == 0
    assert [(e["problem"], e["kind"]) for e in json.loads(capsys.readouterr().out)["entries"]] == [
        ("Alice likes green tea.", "note"), ("Bob likes coffee.", "note")]
