"""ChatKVGraft refuses bad input with kvmemory's typed errors, at construction, in `bind` and per call,
before any model is loaded (the store below is never opened): the same rules as the LlamaIndex
integration (kvmemory.adapters.options)."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from kvmemory import InvalidInput, UnknownOption
from langchain_kvmemory import ChatKVGraft

_NO_STORE = "/nonexistent/kvmemory-validation-store"


@pytest.fixture(scope="module")
def llm() -> ChatKVGraft:
    return ChatKVGraft(store=_NO_STORE)


BAD_OPTIONS = [
    {"max_tokens": 0}, {"max_tokens": -5}, {"max_tokens": 2.5}, {"max_tokens": "many"},
    {"max_new_tokens": 0}, {"max_completion_tokens": -1},
    {"temperature": -1}, {"temperature": float("nan")}, {"temperature": "hot"},
    {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1}, {"seed": 1.5},
    {"k": 0}, {"score_threshold": 2.0}, {"tool_policy": "sometimes"},
]


@pytest.mark.parametrize("opts", BAD_OPTIONS, ids=[repr(o) for o in BAD_OPTIONS])
def test_bad_options_are_refused_at_construction(opts):
    with pytest.raises(InvalidInput) as err:
        ChatKVGraft(store=_NO_STORE, **opts)
    name = next(iter(opts))
    assert ("max_tokens" if name.startswith("max_") else name) in str(err.value)  # the message names it


@pytest.mark.parametrize("opts", [o for o in BAD_OPTIONS if not isinstance(next(iter(o.values())), str)],
                         ids=lambda o: repr(o))
def test_bad_options_are_refused_in_bind_and_per_call(llm, opts):
    with pytest.raises(InvalidInput):
        llm.bind(**opts)
    with pytest.raises(InvalidInput):
        llm.invoke("Hello", **opts)
    with pytest.raises(InvalidInput):
        list(llm.stream("Hello", **opts))


def test_max_tokens_has_chatopenais_and_hugging_faces_spellings():
    assert ChatKVGraft(store=_NO_STORE, max_new_tokens=8).max_tokens == 8
    assert ChatKVGraft(store=_NO_STORE, max_completion_tokens=9).max_tokens == 9
    assert ChatKVGraft(store=_NO_STORE).max_tokens == 256
    with pytest.raises(InvalidInput, match="conflicting"):
        ChatKVGraft(store=_NO_STORE).invoke("Hello", max_tokens=5, max_new_tokens=6)


def test_unknown_options_are_refused_not_ignored(llm):
    with pytest.raises(UnknownOption, match="max_tokns"):
        ChatKVGraft(store=_NO_STORE, max_tokns=8)
    with pytest.raises(UnknownOption):
        llm.bind(max_token=3)
    with pytest.raises(TypeError):  # UnknownOption is Python's TypeError for an unexpected keyword too
        llm.invoke("Hello", max_token=3)


@pytest.mark.parametrize("given", [None, 5, 3.5, {"text": "hi"}], ids=repr)
def test_inputs_that_are_not_a_conversation_are_refused(llm, given):
    with pytest.raises(InvalidInput):
        llm.invoke(given)


@pytest.mark.parametrize("given", ["", "   ", [], [HumanMessage("")], [SystemMessage("  ")],
                                   [HumanMessage("Hi"), AIMessage("Hello!"), HumanMessage(" \n")],
                                   [{"role": "user", "content": None}]],
                         ids=["empty", "blank", "no-messages", "empty-human", "blank-system-only", "blank-last",
                              "none-content"])
def test_empty_questions_are_refused(llm, given):
    with pytest.raises(InvalidInput):
        llm.invoke(given)


def test_a_nul_character_is_refused(llm):
    with pytest.raises(InvalidInput, match="NUL"):
        llm.invoke("Hello\x00world")
