"""`kvmemory demo`, run as a user runs it: its answers are right, its proof holds, its numbers are measured.

The demo runs once per module (`kvmemory demo --json` through `kvmemory.cli.main`, the embedded model,
a temporary store); the tests read that run. What the demo claims is checked against what the test
knows independently: the expected answers come from the demo's problem list (whose worked solutions
the arithmetic verifier re-checks here), not from the demo's output.
"""

from __future__ import annotations

import json

import pytest

from kvmemory import ArithmeticVerifier, InvalidInput, extract_answer
from kvmemory.bench.demo import DEMO_PROBLEMS, _report, run_demo
from kvmemory.cli import main


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["demo", "--json"])
    return rc, json.loads(out.getvalue())


def test_demo_problems_are_clean_and_reworded_with_the_same_numbers():
    from kvmemory import numbers_in

    for p in DEMO_PROBLEMS:
        verdict = ArithmeticVerifier()(p.problem, p.solution, str(p.answer))
        assert verdict.ok, (p.problem, verdict.detail)
        assert extract_answer(p.solution) == p.answer
        assert p.reworded != p.problem
        # the router's number check: the reworded question writes exactly the stored problem's numbers
        assert set(numbers_in(p.reworded)) == set(numbers_in(p.problem))


def test_demo_answers_are_right(demo):
    rc, r = demo
    assert rc == 0, r
    assert r["answer_mode"] == "choices" and r["answer_prefix"] == "The answer is"
    assert [q["expected"] for q in r["questions"]] == [str(p.answer) for p in DEMO_PROBLEMS]
    assert [q["question"] for q in r["questions"]] == [p.reworded for p in DEMO_PROBLEMS]
    for q, p in zip(r["questions"], DEMO_PROBLEMS):
        assert q["expected"] in q["answer"], q
        assert extract_answer(q["answer"]) == p.answer, q
        assert q["correct"] is True
        assert q["routed_to_its_entry"] and q["verified"] == [True], q
        assert q["expected"] in q["choices"]  # chosen among the verified solution's numbers
    assert r["totals"]["right"] == len(DEMO_PROBLEMS) and r["all_right"]


def test_demo_marks_the_model_alone_by_its_answers(demo):
    _, r = demo
    base = r["base"]
    assert [b["expected"] for b in base["questions"]] == [str(p.answer) for p in DEMO_PROBLEMS]
    for b in base["questions"]:
        assert b["correct"] == (extract_answer(b["answer"]) == int(b["expected"]))
        assert 0 < b["tokens_decoded"] <= r["base_budget"] and b["seconds"] > 0
    assert base["right"] == sum(b["correct"] for b in base["questions"])
    assert base["tokens_decoded"] == sum(b["tokens_decoded"] for b in base["questions"])


def test_demo_numbers_come_from_the_run(demo):
    _, r = demo
    qs = r["questions"]
    for q in qs:
        assert q["grafted"] > 0 and q["computed"] > 0 and q["grafted"] + q["computed"] == q["tokens"]
        # the graft ends at the end of a routed entry (a cut: memory/layout.py) or on the grid
        assert q["grafted"] in q["cuts"] or q["grafted"] % r["chunk"] == 0
        assert q["decoded"] > 0 and q["bytes_read"] > 0
        assert q["ttft_graft_s"] > 0 and q["ttft_recompute_s"] > 0
        assert q["ttft_speedup"] == pytest.approx(q["ttft_recompute_s"] / q["ttft_graft_s"])
    # measured, not constants: the questions differ in length and so in time
    assert len({q["ttft_graft_s"] for q in qs}) == len(qs)
    assert len({q["ttft_recompute_s"] for q in qs}) == len(qs)
    t = r["totals"]
    assert t["grafted"] == sum(q["grafted"] for q in qs) and t["decoded"] == sum(q["decoded"] for q in qs)
    assert t["ttft_graft_s"] == pytest.approx(sum(q["ttft_graft_s"] for q in qs))
    assert [e["verifier"] for e in r["entries"]] == ["arithmetic"] * len(DEMO_PROBLEMS)
    assert all("equations correct" in e["verifier_detail"] for e in r["entries"])


def test_demo_verify_proves_bit_identity(demo):
    _, r = demo
    v = r["verify"]
    assert v["checked"] == len(DEMO_PROBLEMS)
    assert v["bit_identical"] == v["checked"] and v["attestation_match"] == v["checked"]
    assert v["kl_max"] == 0.0 and v["argmax_agreement"] == 1.0
    assert r["ok"]


def test_demo_screen_is_rendered_from_the_run(demo):
    _, r = demo
    text = _report(r)
    n = len(DEMO_PROBLEMS)
    assert 'choices="numbers"' in text  # the mode that ran is said
    assert f"with memory: {n}/{n} right" in text and f"model alone: {r['base']['right']}/{n} right" in text
    assert f"{r['verify']['bit_identical']} bit-identical" in text and "KL max 0.0" in text
    assert "argmax agreement 100%" in text
    for q in r["questions"]:
        assert f"{q['ttft_graft_s']:.3f}s" in text and f"{q['ttft_recompute_s']:.3f}s" in text
    assert len(text.splitlines()) <= 30  # one screen
    # a wrong answer is marked as wrong and counted: the marks come from the comparison
    wrong = json.loads(json.dumps(r))
    wrong["questions"][0].update(correct=False, answer_value=1)
    wrong["totals"]["right"] = n - 1
    bad = _report(wrong)
    assert "✗" in bad.split("3. ")[1] and f"with memory: {n - 1}/{n} right" in bad


def test_demo_refuses_an_unknown_answer_mode():
    with pytest.raises(InvalidInput, match="answer_mode"):
        run_demo(answer_mode="guess")
