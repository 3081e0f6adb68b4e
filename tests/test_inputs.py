"""Bad input to the Python API is a typed `InvalidInput` raised before anything is computed (issue 40,
item 7): a lone surrogate, `choices=123`, `max_new_tokens=-1`, `k=2**70`, a NaN threshold.

The memory here runs over an engine, a store and a router that fail the test on any use, so a check
that comes after the first compute (or never) is caught, not just a check that raises something."""

from __future__ import annotations

import pytest

from kvmemory.errors import InvalidInput
from kvmemory.memory.facade import KVMemory


class _Untouchable:
    """Any attribute read is a test failure: the call got past its input checks."""

    def __init__(self, what: str):
        object.__setattr__(self, "_what", what)

    def __getattr__(self, name):
        raise AssertionError(f"{self._what}.{name} was used: the bad input reached compute")


class _Engine(_Untouchable):
    def __init__(self):
        super().__init__("engine")
        object.__setattr__(self, "store", _Untouchable("store"))


@pytest.fixture
def mem():
    return KVMemory(_Engine(), router=_Untouchable("router"))


SURROGATE = "Tom has 3 boxes of 12 eggs\ud800. How many?"


@pytest.mark.parametrize("call", [
    lambda m: m.remember(SURROGATE, "3 * 12 = 36. The answer is 36.", "36"),
    lambda m: m.remember("Tom has 3 boxes of 12 eggs. How many?", "3 * 12 = 36.\udcff The answer is 36.", "36"),
    lambda m: m.recall(SURROGATE),
    lambda m: m.answer(SURROGATE),
    lambda m: m.ask("e0123456789abcdef", SURROGATE),
    lambda m: m.answer("How many eggs?", choices=123),
    lambda m: m.answer("How many eggs?", choices=[1, 2]),
    lambda m: m.answer("How many eggs?", choices=["12", "x\ud800"]),
    lambda m: m.answer("How many eggs?", max_new_tokens=-1),
    lambda m: m.answer("How many eggs?", max_new_tokens=0),
    lambda m: m.answer("How many eggs?", max_new_tokens=2**70),
    lambda m: m.answer("How many eggs?", max_new_tokens=True),
    lambda m: m.answer("How many eggs?", k=2**70),
    lambda m: m.answer("How many eggs?", threshold=float("nan")),
    lambda m: m.answer("How many eggs?", contrast=2.0),
    lambda m: m.answer("How many eggs?", prior=-0.5),
    lambda m: m.answer_from("How many eggs?", [], prior=float("inf")),
    lambda m: m.answer_from("How many eggs?", [], max_new_tokens=-1),
    lambda m: m.recall("How many eggs?", k=2**70),
    lambda m: m.recall("How many eggs?", threshold=7.0),
    lambda m: m.ask("e0123456789abcdef", "How many eggs?", max_new_tokens=-1),
    lambda m: m.chat([{"role": "user", "content": "How many eggs?"}], k=2**70),
    lambda m: m.chat([{"role": "user", "content": "How many eggs?"}], max_new_tokens=-5),
    lambda m: m.get("e\ud800"),
    lambda m: m.list(namespace="tenant\udcff"),
], ids=["remember-problem-surrogate", "remember-solution-surrogate", "recall-surrogate", "answer-surrogate",
        "ask-surrogate", "choices-int", "choices-ints", "choices-surrogate", "max-new-tokens-negative",
        "max-new-tokens-zero", "max-new-tokens-huge", "max-new-tokens-bool", "k-huge", "threshold-nan",
        "contrast-out-of-range", "prior-negative", "answer-from-prior-inf", "answer-from-negative-tokens", "recall-k-huge", "recall-threshold-7",
        "ask-negative-tokens", "chat-k-huge", "chat-negative-tokens", "get-surrogate-id", "list-surrogate-namespace"])
def test_bad_input_is_invalid_input_before_any_compute(mem, call):
    with pytest.raises(InvalidInput) as err:
        call(mem)
    assert str(err.value)  # a message that says what to give instead


def test_the_messages_name_the_argument_and_the_bound(mem):
    with pytest.raises(InvalidInput, match=r"max_new_tokens must be between 1 and \d+, got -1"):
        mem.answer("How many eggs?", max_new_tokens=-1)
    with pytest.raises(InvalidInput, match=r"k must be between 1 and 1000, got 1180591620717411303424"):
        mem.recall("How many eggs?", k=2**70)
    with pytest.raises(InvalidInput, match=r'choices must be "numbers" or a list of strings, got int'):
        mem.answer("How many eggs?", choices=123)
    with pytest.raises(InvalidInput, match=r"problem is not valid text: character 26 is a lone surrogate"):
        mem.remember(SURROGATE, "3 * 12 = 36. The answer is 36.", "36")
