"""The recurring-problem bench on outside data (GSM-Symbolic from reasoning-gym): the loader gives
verified worked solutions and true siblings, the rewording keeps the numbers and knows no dataset,
and a tiny run reports every question kind with memory used where it should be and no sibling leak."""

from __future__ import annotations

import json

import pytest

from kvmemory.bench.gsm_symbolic import load_problems
from kvmemory.bench.paraphrase import paraphrase
from kvmemory.memory.verifiers import ExactAnswerVerifier, extract_value, numbers_in



def test_problems_are_distinct_templates_with_verified_solutions_and_true_siblings():
    pairs = load_problems(12, seed=3)
    assert len(pairs) >= 10  # a template whose draws never change the answer is left out
    assert len({p.original.template for p in pairs}) == len(pairs)
    verify = ExactAnswerVerifier()
    for p in pairs:
        o, s = p.original, p.sibling
        assert verify(o.question, o.solution, o.answer).ok
        assert extract_value(o.solution) == o.value
        assert s.template == o.template and s.value != o.value
        assert sorted(numbers_in(s.question)) != sorted(numbers_in(o.question))
    assert [p.original.id for p in load_problems(12, seed=3)] == [p.original.id for p in pairs]  # seeded


def test_paraphrase_asks_first_keeps_numbers_and_changes_the_words():
    text = ("Isabella can peel 4 mushrooms a minute and saute 30 mushrooms in 20 minutes. She buys 240 mushrooms. "
            "How long will it take her to peel and saute them all in total?")
    out = paraphrase(text)
    assert out.startswith("How much time will it take her")
    assert "purchases 240" in out and "altogether" in out
    assert sorted(numbers_in(out)) == sorted(numbers_in(text))
    for p in load_problems(20, seed=0):
        q = p.original.question
        assert paraphrase(q) != q and sorted(numbers_in(paraphrase(q))) == sorted(numbers_in(q))


def test_tiny_run_reports_every_kind(real_memory):
    from kvmemory.bench.recurring_outside import KINDS, format_table, run_outside_bench

    r = run_outside_bench(real_memory, problems=1, seed=1, base_budget=8, progress=False)
    json.dumps(r)
    assert r["problems"] == 1 and set(r["kinds"]) == set(KINDS)
    verbatim = r["kinds"]["verbatim"]
    # A verbatim question routes to its own entry and is answered from it (grafted, a few tokens).
    assert verbatim["routed_to_its_entry"] == 1.0 and verbatim["kvmemory"]["used_memory"] == 1.0
    assert verbatim["kvmemory"]["grafted_tokens_per_question"] > 0
    # A sibling writes other numbers: the number check keeps it away from the original's entry.
    assert r["kinds"]["sibling"]["kvmemory"]["used_memory"] == 0.0
    assert r["sibling_leaks"] == 0 and r["sibling_leak_rate"] == 0.0
    given = r["siblings_given_the_originals_answer_details"]
    assert r["siblings_given_the_originals_answer"] == len(given) and not any(x["used_memory"] for x in given)
    for kind in KINDS:
        assert r["kinds"][kind]["model_alone"]["used_memory"] == 0.0
        assert r["kinds"][kind]["model_alone"]["decode_tokens_per_question"] <= 8
    assert "sibling leak rate" in format_table(r)


def test_prior_study_counts_the_kvmemory_side_at_each_prior(real_memory):
    from kvmemory.bench.recurring_outside import study_prior

    r = study_prior(real_memory, problems=2, seed=1, priors=(0.0, 2.5), progress=False)
    json.dumps(r)
    assert r["problems"] == 2 and r["priors"] == [0.0, 2.5] and set(r["kinds"]) == {"verbatim", "reworded"}
    for row in r["kinds"].values():
        assert row["questions"] == 2 and row["routed_to_its_entry"] == 2  # verbatim and reworded: its own entry
        assert 0 <= row["right_at_prior_0"] <= 2 and 0 <= row["right_at_prior_2.5"] <= 2
    with pytest.raises(Exception, match="prior"):
        study_prior(real_memory, problems=1, priors=(-1.0,), progress=False)
