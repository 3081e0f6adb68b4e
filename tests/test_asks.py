"""Is it the same question? (memory/asks.py, issue 48 item 2): a question with a stored problem's numbers
that asks another quantity does not get the stored answer; a rewording still does."""

from __future__ import annotations

from fractions import Fraction

import pytest

from kvmemory.memory.answers import OTHER_ASK, OTHER_ASK_NO_CHOICES
from kvmemory.memory.asks import ask_of, asks_differ
from kvmemory.memory.verifiers import extract_value

MUFFINS = "A bakery bakes 24 muffins per tray and fills 5 trays. It sells 87 muffins. How many muffins are left?"
MUFFINS_SOLUTION = "24 × 5 = 120 muffins. 120 - 87 = 33. The answer is 33."


@pytest.mark.parametrize("question", [
    "A bakery fills five trays with twenty-four muffins on each tray and then sells eighty-seven muffins. "
    "How many muffins remain?",
    "Bakery: 5 trays × 24 muffins/tray, 87 muffins sold. Muffins left = ?",
    "How many muffins are left if a bakery sells 87 muffins after filling 5 trays that hold 24 muffins each?",
    MUFFINS,
])
def test_a_rewording_asks_the_same(question):
    assert asks_differ(question, MUFFINS) is None


def test_a_rewording_may_name_what_the_stored_ask_left_unsaid():
    """The README's example: "How many are left?" stored, "How many eggs remain?" asked."""
    assert asks_differ("Tom owns 3 boxes with 12 eggs each; 5 break. How many eggs remain?",
                       "Tom has 3 boxes of 12 eggs and breaks 5. How many are left?") is None


@pytest.mark.parametrize("question, problem, why", [
    ("A bakery bakes 24 muffins per tray and fills 5 trays. It sells 87 muffins. "
     "How many muffins did it bake before selling any?", MUFFINS, "aggregate: before"),
    ("A rectangular garden is 12 meters long and 7 meters wide. What is its perimeter in meters?",
     "A rectangular garden is 12 meters long and 7 meters wide. What is its area in square meters?", "measure:"),
    ("Ana walks 5 km a day, 6 days a week. How many kilometers does she walk in each week?",
     "Ana walks 5 km a day, 6 days a week. How many kilometers does she walk in 2 weeks?", "aggregate: share"),
    ("A worker earns $15 an hour for 40 hours a week. How much does the worker earn over a fortnight?",
     "A worker earns $15 an hour for 40 hours a week. How much does the worker earn in a week?", "period:"),
    ("Sam has 12 marbles and Ann has 9. How many marbles do Sam and Ann have together?",
     "Sam has 12 marbles and Ann has 9. How many marbles does Sam have?", "subject: ann"),
])
def test_another_quantity_is_told_apart(question, problem, why):
    got = asks_differ(question, problem)
    assert got is not None and got.startswith(why), got


def test_the_ask_is_the_question_sentence_without_its_conditions():
    assert ask_of("If 35 students are on the bus, how many seats are empty?") == "how many seats are empty?"
    assert ask_of(MUFFINS) == "How many muffins are left?"
    assert ask_of("") == ""


def test_answer_does_not_give_the_stored_answer_to_another_ask(real_memory):
    """With choices="numbers": a rewording gets the stored answer from memory; another ask gets no prior
    and no stored answer among its choices (answered from the working, flagged); ask_check=False offers
    the stored answer as before."""
    mem = real_memory
    mem.remember(MUFFINS, MUFFINS_SOLUTION, answer="33")
    kw = dict(answer_prefix="The answer is", choices="numbers")
    same = mem.answer("Bakery: 5 trays × 24 muffins/tray, 87 muffins sold. Muffins left = ?", **kw)
    assert same.outcome is None and same.source == "memory" and extract_value(same.text) == Fraction(33)
    other_q = ("A bakery bakes 24 muffins per tray and fills 5 trays. It sells 87 muffins. "
               "How many muffins did it bake before selling any?")
    other = mem.answer(other_q, **kw)
    assert other.entries and other.outcome == OTHER_ASK and other.source == "intermediate"
    assert "another quantity" in other.reason and "before" in other.reason
    assert "33" not in other.choices and set(other.choices) == {"24", "5", "120", "87"}
    assert extract_value(other.text) != Fraction(33)
    assert other.to_json()["source"] == "intermediate"
    unchecked = mem.answer(other_q, ask_check=False, **kw)
    assert unchecked.outcome is None and "33" in unchecked.choices


def test_explicit_choices_are_kept_but_the_stored_answer_gets_no_prior(real_memory):
    mem = real_memory
    problem = "A rectangular garden is 12 meters long and 7 meters wide. What is its area in square meters?"
    mem.remember(problem, "12 × 7 = 84. The answer is 84.", answer="84")
    perimeter = "A rectangular garden is 12 meters long and 7 meters wide. What is its perimeter in meters?"
    ans = mem.answer(perimeter, choices=["84", "38"], answer_prefix="The answer is")
    assert ans.outcome == OTHER_ASK and ans.choices == ["84", "38"] and "measure" in ans.reason
    only = mem.answer(perimeter, choices="numbers", answer_prefix="The answer is")
    assert only.outcome == OTHER_ASK and set(only.choices) == {"12", "7"}


def test_another_ask_with_no_other_number_in_the_working_is_not_answered(real_memory):
    mem = real_memory
    problem = "A square tile has sides of 30 cm. What is its area in square centimeters?"
    mem.remember(problem, "The area is 900. The answer is 900.", answer="900")
    ans = mem.answer("A square tile has sides of 30 cm. What is its perimeter in cm?", choices="numbers",
                     answer_prefix="The answer is")
    assert ans.entries, "the question must route to the entry (the default embedder, pinned in the wheel)"
    assert ans.outcome == OTHER_ASK_NO_CHOICES and ans.source == "none" and ans.text == ""
    assert "another quantity" in ans.reason and "no other number" in ans.reason
    assert ans.report.tokens_computed == ans.report.tokens_scored == 0


def test_chat_answers_a_recurring_problem_from_its_verified_solution(real_memory):
    """Issue 48 item 1: chat (KVMemory.chat and run_chat, which the server and the frameworks call) answers
    a routed rewording as answer(choices="numbers") does; another ask or other numbers decode freely."""
    from kvmemory.adapters.chat import ChatRequest, run_chat
    from kvmemory.adapters.shared import borrow_memory

    mem = real_memory
    mem.remember(MUFFINS, MUFFINS_SOLUTION, answer="33")
    rewording = "Bakery: 5 trays × 24 muffins/tray, 87 muffins sold. Muffins left = ?"
    direct = mem.answer(rewording, answer_prefix="The answer is", choices="numbers")
    said = []
    got = mem.chat([{"role": "user", "content": rewording}], on_text=said.append)
    assert got.text == direct.text == "The answer is 33." and said == [got.text] and got.source == "memory"
    out = run_chat(borrow_memory(mem), ChatRequest(turns=[{"role": "user", "content": rewording}]))
    assert out.text == direct.text and out.notes["recurrence"]["entry"] == got.entries[0]
    assert out.stats.passes == 1 and out.finish_reason == "stop"
    free = mem.chat([{"role": "user", "content": rewording}], recurrence=False, max_new_tokens=8)
    assert free.choices == []  # decoded freely, as before
    other_q = ("A bakery bakes 24 muffins per tray and fills 5 trays. It sells 87 muffins. "
               "How many muffins did it bake before selling any?")
    other = run_chat(borrow_memory(mem), ChatRequest(turns=[{"role": "user", "content": other_q}],
                                                       max_tokens=8))
    assert "recurrence" not in other.notes and other.stats.tokens_decoded > 0


def test_a_recurrence_stores_what_it_computed_and_the_same_question_grafts_it(real_memory):
    """A server's chat (`cache` on: run_chat's store_blocks=True) stores the blocks a recurrence's two prompts
    compute (the entry then the question, and the question alone for the contrast): the same question asked
    again grafts them and scores every choice to the same bits. The memory's own policy ("multi": one entry
    stores nothing) and store_blocks=False leave the store as it was."""
    from kvmemory.adapters.chat import ChatRequest, run_chat
    from kvmemory.adapters.shared import borrow_memory

    mem = real_memory
    mem.remember(MUFFINS, MUFFINS_SOLUTION, answer="33")
    rewording = "Bakery: 5 trays × 24 muffins/tray, 87 muffins sold. Muffins left = ?"
    hits = mem.route(rewording, 1)
    blocks = lambda: mem.store.stats().blocks  # noqa: E731
    mem.answer_from(rewording, hits, answer_prefix="The answer is", choices="numbers")  # keeps the preamble's block
    held = blocks()
    for store_blocks in (None, False):
        mem.answer_from(rewording, hits, answer_prefix="The answer is", choices="numbers", store_blocks=store_blocks)
        assert blocks() == held
    first = mem.answer_from(rewording, hits, answer_prefix="The answer is", choices="numbers", store_blocks=True)
    assert first.report.blocks_stored >= 2 and blocks() == held + first.report.blocks_stored  # both prompts
    again = mem.answer_from(rewording, hits, answer_prefix="The answer is", choices="numbers", store_blocks=True)
    assert again.text == first.text == "The answer is 33."
    assert again.choice_scores == first.choice_scores  # the same floats, bit for bit
    assert again.report.tokens_grafted > first.report.tokens_grafted
    assert again.report.tokens_scored < first.report.tokens_scored  # the contrast's question grafted too
    out = run_chat(borrow_memory(mem), ChatRequest(turns=[{"role": "user", "content": rewording}], store_blocks=True))
    assert out.text == first.text and out.stats.prompt_grafted == again.report.tokens_grafted

@pytest.mark.parametrize("which", ["fresh", "fresh2"])
def test_the_blind_asks_sets_load_whole(which):
    """`bench rewordings --set fresh|fresh2`: 40 problems, three rewordings each (words, units, reordered),
    and one other ask each whose answer is not the stored one."""
    from kvmemory.bench.rewordings import KINDS, load_set

    s = load_set(which)
    assert s.__name__ == f"kvmemory/bench/data/asks_{which}.json"
    assert len(s.PROBLEMS) == len(s.OTHER_ASKS) == 40
    assert all(set(p[3]) == set(KINDS) and all(p[3].values()) for p in s.PROBLEMS)
    assert all(answer != s.PROBLEMS[i][2] for i, _, answer in s.OTHER_ASKS)
