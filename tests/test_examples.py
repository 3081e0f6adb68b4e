"""The examples, run as a user runs them (a subprocess, default arguments, a throw-away store): every
answer they print is right, checked here against answers computed here, not against their own marks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

pytestmark = pytest.mark.slow


def run_example(name: str, *args: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "utf-8"}
    p = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, env=env,
                       timeout=1800)
    assert p.returncode == 0, f"{name} exited {p.returncode}:\n{p.stdout}\n{p.stderr[-4000:]}"
    return p.stdout


def _marks(out: str) -> tuple[int, int]:
    return out.count("✓"), out.count("✗")


def test_langchain_agent_answers_right():
    from kvmemory import extract_answer

    out = run_example("langchain_agent.py")
    answers = re.findall(r"^  answer    : (.*), expected (\d+): ([✓✗])$", out, re.M)
    assert len(answers) == 2, out
    for text, expected, _ in answers:
        assert int(expected) == 1234 * 56
        assert extract_answer(text) == 1234 * 56, out
    assert _marks(out) == (2, 0), out
    assert "2/2 answers right" in out and "prompt tokens grafted: yes" in out


def test_llamaindex_agent_answers_right():
    from kvmemory import extract_answer

    out = run_example("llamaindex_agent.py")
    final = re.search(r"^final answer: (.*)$", out, re.M)
    assert final, out
    assert extract_answer(final.group(1)) == 12 * 7, out
    assert "expected 84: ✓" in out and _marks(out) == (1, 0), out


def test_llamaindex_query_engine_answers_right():
    from kvmemory import extract_answer, generate_problems

    out = run_example("llamaindex_query_engine.py")
    problems = generate_problems(10, 0, rewordings=2)  # what the example remembers and asks (seed 0)
    asked = [problems[0], problems[0], problems[1], problems[2]]
    answers = re.findall(r"^  (?:answer|reply): (.*)$", out, re.M)
    assert len(answers) == len(asked), out
    for text, p in zip(answers, asked):
        assert extract_answer(text) == p.answer, (text, p.answer, out)
    assert _marks(out) == (len(asked), 0), out
    assert f"{len(asked)}/{len(asked)} answers right" in out
    assert "refused a wrong solution" in out and "hit rate 1.000" in out
    # the grafted answers read the stored KV: at least one block grafted each
    grafted = [int(g) for g in re.findall(r"\[KVGraftSynthesizer\].*?tokens grafted (\d+)", out, re.S)]
    assert len(grafted) == 2 and all(g > 0 for g in grafted), out


def test_openai_agent_server_answers_right():
    """The example starts `kvmemory serve` itself and talks to it with the openai client only."""
    from kvmemory import extract_answer

    out = run_example("openai_agent_server.py")
    answers = re.findall(r"^  answer : (.*), expected (\d+): ([✓✗])$", out, re.M)
    assert len(answers) == 2, out
    for text, expected, _ in answers:
        assert int(expected) == 1234 * 56
        assert extract_answer(text) == 1234 * 56, out
    assert _marks(out) == (2, 0), out
    assert "calls calculator(" in out and "2/2 answers right" in out and "prompt tokens grafted: yes" in out


def test_check_attestation_needs_an_attestation(tmp_path):
    """The attestation checker (tests/test_attestation.py runs it on real attestations, without kvmemory):
    with no argument it prints its usage, with a file that holds no attestation it says so; exit 2."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, str(EXAMPLES / "check_attestation.py")], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 2 and "usage: check_attestation.py" in p.stderr, p.stderr
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    p = subprocess.run([sys.executable, str(EXAMPLES / "check_attestation.py"), str(empty)], capture_output=True,
                       text=True, env=env, timeout=300)
    assert p.returncode == 2 and "holds no attestation" in p.stderr, p.stderr
