"""A small sample of the verifier bench (`python -m kvmemory.bench.verifier`): GSM-Symbolic worked
solutions as the dataset writes them, without their "#### N" line, and concluding in a sentence, plus the
hand-written cases, each with wrong-answer twins. No wrong answer is accepted, and the exact-answer
verifier refuses no correct solution (the full run's figures: BENCHMARKS.md, "Verifier")."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("reasoning_gym")

from kvmemory.bench.verifier import build_sets, main, measure  # noqa: E402
from kvmemory.memory.verifiers import ArithmeticVerifier, ExactAnswerVerifier  # noqa: E402

CORRECT = ["gsm-marked", "gsm-unmarked", "gsm-sentence", "handwritten", "handwritten-heldout"]


@pytest.fixture(scope="module")
def result():
    verifiers = {"exact": ExactAnswerVerifier(), "arith": ArithmeticVerifier()}
    return measure(build_sets(problems=60, seed=5), verifiers)


def test_every_set_is_measured(result):
    wrong = [f"{s}/wrong-{k}" for s in CORRECT for k in ("conclusion", "expected")]
    assert sorted(result) == sorted(CORRECT + wrong)
    for s in CORRECT[:3]:
        assert result[s]["exact"]["cases"] == 60
        assert result[f"{s}/wrong-expected"]["exact"]["cases"] == 60
        assert result[f"{s}/wrong-conclusion"]["exact"]["cases"] >= 55  # a few unmarked lines do not write N
    assert result["handwritten"]["exact"]["cases"] >= 12 and result["handwritten-heldout"]["exact"]["cases"] >= 12


def test_no_wrong_answer_is_accepted(result):
    for set_name, per in result.items():
        if "/wrong-" in set_name:
            for verifier, row in per.items():
                assert row["false_acceptances"] == 0, (set_name, verifier, row["examples"])


def test_exact_answer_refuses_no_correct_solution(result):
    for s in CORRECT:
        row = result[s]["exact"]
        assert row["false_refusals"] == 0, (s, row["examples"])


def test_arithmetic_refuses_correct_solutions_only_for_their_equations(result):
    # Its refusals of correct solutions come from the equations it cannot parse or finds off (units inside
    # expressions, rounding), never from reading the conclusion: the same count however the solution concludes.
    gsm = [result[s]["arith"] for s in CORRECT[:3]]
    assert len({row["false_refusals"] for row in gsm}) == 1
    for s in CORRECT:
        reasons = result[s]["arith"]["refusal_reasons"]
        assert set(reasons) <= {"wrong arithmetic", "no equations"}, (s, reasons)


def test_the_command_prints_json(capsys):
    assert main(["--problems", "3", "--seed", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "verifier" and out["problems"] == 3
    assert out["verifiers"] == ["exact-answer v3", "arithmetic v4"]
    row = out["sets"]["gsm-sentence"]["exact-answer v3"]
    assert row["cases"] == 3 and row["false_refusals"] == 0
