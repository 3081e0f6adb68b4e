"""Natural rewordings of a stored problem route to it and are answered from it; siblings (other numbers)
and unrelated questions do not route (issue 41 item 2). Items from the report set
(bench/rewordings_heldout.py); figures over whole sets: `python -m kvmemory.bench.rewordings`."""

from __future__ import annotations

from fractions import Fraction

import pytest

from kvmemory.bench.rewordings_heldout import PROBLEMS, UNRELATED
from kvmemory.errors import InvalidInput
from kvmemory.memory.quantities import numbers_agree, question_numbers
from kvmemory.memory.verifiers import extract_value

PREFIX = "The answer is"


def _problem(start: str):
    return next(p for p in PROBLEMS if p[0].startswith(start))


@pytest.mark.parametrize("text, values", [
    ("A baker made twenty-four muffins and sold eighteen of them.", {24, 18}),
    ("seventy-eight, eighty-five and ninety-two", {78, 85, 92}),
    ("one thousand two hundred litres", {1200}),
    ("Flow rate 40 L/min, volume 1,200 L.", {40, 1200}),
    ("Fuel consumption 6 L/100 km; distance 450 km.", {6, 100, 450}),
    ("a car burns six litres every hundred kilometres", {6, 100}),
    ("Find the area in cm^2 of a 7 cm x 5 cm rectangle.", {7, 5}),
    ("Shirt: $40.00, discount 25 %.", {40, 25}),
    ("a four-hundred-meter track and a ten-dollar bill", {400, 10}),
    ("three dollars and fifty cents, and ten cents", {Fraction(7, 2), Fraction(1, 10)}),
    ("two and a half hours, one quarter of them, three point six metres", {Fraction(5, 2), Fraction(1, 4),
                                                                          Fraction(18, 5)}),
    ("minus four degrees", {4}),
    ("Morning: −4 °C", {4}),
    ("A runner finishes one lap in ninety seconds.", {90}),  # the value 1 is left out: "a lap" is the same
])
def test_question_numbers_reads_values_however_written(text, values):
    assert question_numbers(text) == frozenset(Fraction(v) for v in values)


def test_clock_times_are_times():
    assert question_numbers("from 10 pm to 6:30 am") == question_numbers("22:00 → 06:30") \
        == question_numbers("from ten p.m. until six thirty a.m.") == {("time", 22 * 60), ("time", 6 * 60 + 30)}


def test_rewordings_agree_and_siblings_do_not():
    for problem, _, _, rewordings, (sibling, _) in PROBLEMS:
        for kind, q in rewordings.items():
            assert numbers_agree(q, problem), (kind, q)
        assert numbers_agree(sibling, problem) is False, sibling
    assert numbers_agree("What is the capital of Australia?", PROBLEMS[0][0]) is None


@pytest.fixture
def stored(real_memory):
    picked = [_problem("A rectangle is 7 cm"), _problem("A train travels at 80 km"), _problem("A pool is filled at 40")]
    entries = [real_memory.remember(p[0], p[1], answer=p[2]) for p in picked]
    return real_memory, picked, entries


def test_rewordings_route_and_are_answered(stored):
    mem, picked, entries = stored
    asked = [(0, "units"), (0, "words"), (1, "words"), (2, "words"), (2, "units")]
    for i, kind in asked:
        q = picked[i][3][kind]
        ans = mem.answer(q, answer_prefix=PREFIX, choices="numbers")
        assert ans.entries == [entries[i].id], (kind, q, ans.scores)
        assert extract_value(ans.text) == Fraction(picked[i][2]), (q, ans.text)


def test_siblings_and_unrelated_questions_route_nowhere(stored):
    mem, picked, entries = stored
    for problem, _, answer, _, (sibling, _) in picked:
        ans = mem.answer(sibling, answer_prefix=PREFIX, choices="numbers", max_new_tokens=1)
        assert ans.entries == [], sibling
    # a sibling written in words is refused too (its numbers are read as values)
    words_sibling = "A train goes eighty kilometres an hour for five hours. How far does it go?"
    assert mem.answer(words_sibling, max_new_tokens=1).entries == []
    for q in UNRELATED[::10]:
        assert mem.answer(q, max_new_tokens=1).entries == [], q


def test_a_given_threshold_gates_every_route(stored):
    mem, picked, entries = stored
    q = picked[2][3]["units"]  # "Flow rate 40 L/min, volume 1,200 L. Time to fill in min?"
    score = mem.recall(q, k=1, threshold=0.0)[0].score
    assert score < 0.83  # below the threshold: routed by its numbers
    assert mem.answer(q, max_new_tokens=1).entries == [entries[2].id]
    assert mem.answer(q, threshold=0.83, max_new_tokens=1).entries == []
    assert mem.answer(q, threshold=0.83, number_threshold=0.6, max_new_tokens=1).entries == [entries[2].id]
    # recall without the number check lists by the threshold alone
    assert mem.recall(q, k=1) == []
    assert [h.entry.id for h in mem.recall(q, k=1, number_check=True)] == [entries[2].id]



def test_chat_routes_rewordings_by_their_numbers_and_keeps_other_numbers(stored):
    """`chat` (and so the server's chat completions and the framework chat models) routes a rewording that
    scores under the threshold by its numbers, as `answer` does; an entry above the threshold still
    routes whatever numbers it writes (a worked example in the conversation: memory/routing.py LIFT)."""
    mem, picked, entries = stored
    q = picked[2][3]["units"]  # "Flow rate 40 L/min, volume 1,200 L. Time to fill in min?"
    assert mem.recall(q, k=1) == []  # under the threshold: only its numbers route it
    prompt = mem.chat_prompt([{"role": "user", "content": q}])
    assert [h.entry.id for h in prompt.hits] == [entries[2].id]
    ans = mem.chat([{"role": "user", "content": q}], max_new_tokens=1)
    assert ans.entries == [entries[2].id] and ans.report.tokens_grafted > 0
    sibling = picked[1][4][0]  # the train problem with one number changed
    score = mem.recall(sibling, k=1)[0].score
    assert score >= 0.83 and mem.answer(sibling, max_new_tokens=1).entries == []
    assert [h.entry.id for h in mem.chat_prompt([{"role": "user", "content": sibling}]).hits] == [entries[1].id]
    mem.number_check = False  # no number check: the threshold alone, as recall
    assert mem.chat_prompt([{"role": "user", "content": q}]).hits == []
    with pytest.raises(InvalidInput, match="number_check"):
        mem.recall(q, number_check="yes")

def test_other_asks_are_the_same_numbers_asking_another_quantity():
    """The "other asks" set (bench/rewordings_other_asks.py): one question per stored problem of each set,
    the same situation and numbers, another quantity asked, so the stored answer is wrong for it."""
    from kvmemory.bench import rewordings_calibration, rewordings_other_asks

    for probs, asks in ((rewordings_calibration.PROBLEMS, rewordings_other_asks.CALIBRATION),
                        (PROBLEMS, rewordings_other_asks.REPORT)):
        assert [i for i, _, _ in asks] == list(range(len(probs)))
        for i, q, answer in asks:
            assert Fraction(answer) != Fraction(probs[i][2]) and q != probs[i][0]


def test_the_bench_reports_every_kind_of_question(real_memory):
    from kvmemory.bench.rewordings import format_table, run_rewordings_bench

    r = run_rewordings_bench(real_memory, which="report", problems=2, unrelated=2, progress=False)
    assert r["problems"] == 2 and r["rewordings"]["questions"] == 6 and r["siblings"]["questions"] == 2
    assert r["prior"] == 2.5 and r["contrast"] == 0.5 and r["unrelated"]["questions"] == 2
    other = r["other_asks"]
    assert other["questions"] == 2 and len(other["details"]) == 2
    assert 0 <= other["given_stored_answer"] + other["answered_right"] <= 2
    assert "other asks (same numbers, another quantity)" in format_table(r)
    with pytest.raises(Exception, match="prior"):
        run_rewordings_bench(real_memory, which="report", problems=1, unrelated=0, prior=-1.0, progress=False)


def test_cli_calibrates_the_number_threshold_on_the_calibration_set(capsys):
    """`kvmemory bench rewordings --calibrate` (no model): the calibration set gives the number threshold
    that routing uses (memory/routing.py), by the rule in bench/rewordings.calibrate."""
    import json

    from kvmemory.cli import main
    from kvmemory.routing.embedders import number_threshold_for, resolve_embedder

    assert main(["bench", "rewordings", "--set", "calibration", "--calibrate", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["set"] == "calibration" and r["number_threshold"] == number_threshold_for(resolve_embedder(None)) == 0.61


def test_cli_ask_takes_the_prior(tmp_path, capsys):
    """`kvmemory ask --choices numbers --prior N`: the prior reaches the choice (0: the model's own), and a
    negative one is refused before the model loads."""
    import json

    from kvmemory.cli import main

    store = ["--store", str(tmp_path / "store")]
    assert main(["remember", *store, "--json", "--problem", "Lena scored 78, 85 and 92 on three tests. What is her "
                 "average score?", "--solution", "78 + 85 + 92 = 255. 255 / 3 = 85. The answer is 85.",
                 "--answer", "85"]) == 0
    eid = json.loads(capsys.readouterr().out)["remembered"][0]["id"]
    q = "Test scores: 78 pts, 85 pts, 92 pts (n = 3). Average in pts = ?"
    common = ["ask", q, *store, "--choices", "numbers", "--answer-prefix", PREFIX, "--json"]
    got = {}
    for prior in ("0", "2.5"):
        assert main([*common, "--prior", prior]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["entries"] == [eid]
        got[prior] = out["text"]
    assert got == {"0": "The answer is 255.", "2.5": "The answer is 85."}
    assert main([*common, "--prior", "-1"]) == 2
    assert "prior must be a number" in json.loads(capsys.readouterr().out)["message"]
