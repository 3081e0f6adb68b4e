"""A prompt's token ids and where its segments end (the runner's cuts).

A prompt that answers from memory is made of segments: the routed entries (the first one's stored token
ids as they are), then the conversation, ending with the assistant's turn opened. Each segment's end is a
cut (engine/runner.py): the runner ends a prefill chunk there, so the segment's last, partial chunk is a
block of its own (a tail block) that a later prompt starting with the same segment grafts, and an entry
shorter than the grid C is grafted whole instead of not at all. The cuts are positions in the prompt's
ids, found by rendering each prefix and keeping the ones whose ids are the prompt's own first ids (a
chat template that renders a prefix otherwise gives no cut there: nothing is guessed).

Cuts of a chat prompt: the end of each routed entry, of an explicit system turn, of every earlier
prompt of the conversation (each assistant turn's start: where the previous call's prompt ended, so
turn k grafts what turn k-1 stored), and of the prompt itself (so the tail it computes is stored for
the next turn); without entries also the end of the template's preamble (`preamble`: its default
system turn, which every such prompt then grafts). Cuts of an answer's prompt (`question_layout`): the
same, its own end included when an answer prefix follows it (the same question asked again grafts all
but the prefix). Cuts of an entry's proof: the entry's end, followed by a fixed probe question.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from kvmemory.memory.prompts import Message, continuation_ids, entry_messages, render_ids

# The follow-up `remember` proves an entry's blocks with: the entry's ids (all of them grafted, its tail
# block included), then this question computed, then a few decoded tokens (engine.verify_tokens).
PROBE_QUESTION = "What is the final answer?"


@dataclass(slots=True, frozen=True)
class Layout:
    """Token ids and the positions where their segments end (sorted, inside (0, len(ids)])."""

    ids: list[int]
    cuts: tuple[int, ...] = ()


def _prefix_len(ids: Sequence[int], part: Sequence[int] | None) -> int | None:
    """len(part) when `part` is a non-empty prefix of `ids`, else None."""
    if not part or len(part) > len(ids) or list(ids[: len(part)]) != list(part):
        return None
    return len(part)


# A template preamble shorter than this gets no cut: a block that small costs a store read for little compute.
MIN_PREAMBLE = 16
_PREAMBLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def preamble(tokenizer) -> tuple[int, ...]:
    """The ids every chat opening with a user turn starts with, whatever the user wrote: what the chat
    template writes first (SmolLM2's and Qwen2.5's default system turn and the user turn's header), the
    common prefix of two renderings that differ from the user's first character on; () when shorter
    than MIN_PREAMBLE. A prompt without entries is cut at its end (when it starts with it), so every such
    prompt grafts the block the first one stored there, as llama.cpp's server reuses its slot's prefix."""
    try:
        return _PREAMBLES[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable: computed each time
        return _preamble(tokenizer)
    _PREAMBLES[tokenizer] = out = _preamble(tokenizer)
    return out


def _preamble(tokenizer) -> tuple[int, ...]:
    a = render_ids(tokenizer, [{"role": "user", "content": "1"}], add_generation_prompt=False)
    b = render_ids(tokenizer, [{"role": "user", "content": "Z"}], add_generation_prompt=False)
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return tuple(a[:n]) if n >= MIN_PREAMBLE else ()


def _cuts(found, n: int) -> tuple[int, ...]:
    return tuple(sorted({c for c in found if c is not None and 0 < c <= n}))


def chat_layout(tokenizer, messages: Sequence[Message], entries: Sequence = ()) -> Layout:
    """The ids of a chat with `entries` (EntryRecords) placed before the conversation (after its system
    message, if any), ending with the assistant's turn opened, and the cuts (module docstring). Without
    a system message the first entry's stored ids are the prompt's prefix, so they are grafted as they
    are (when the chat template extends the entry's rendering); with one, the entries follow it."""
    msgs = list(messages)
    if entries and msgs[0]["role"] != "system":
        first = entry_messages(entries[0].problem, entries[0].solution, entries[0].answer)
        extra = [m for e in entries[1:] for m in entry_messages(e.problem, e.solution, e.answer)]
        tail = continuation_ids(tokenizer, first, extra + msgs)
        if tail is not None:
            head = list(entries[0].token_ids)
            ids = head + tail
            later = [continuation_ids(tokenizer, first, extra[:j], add_generation_prompt=False)
                     for j in range(2, len(extra) + 1, 2)]  # each later entry's end
            turns = [continuation_ids(tokenizer, first, extra + msgs[:i], add_generation_prompt=True)
                     for i, m in enumerate(msgs) if m["role"] == "assistant"]
            found = [len(head)] + [None if (k := _prefix_len(tail, p)) is None else len(head) + k
                                   for p in later + turns]
            return Layout(ids, _cuts(found + [len(ids)], len(ids)))
    context = [m for e in entries for m in entry_messages(e.problem, e.solution, e.answer)]
    head = msgs[:1] if msgs[0]["role"] == "system" else []
    whole = head + context + msgs[len(head):]
    ids = render_ids(tokenizer, whole, add_generation_prompt=True)
    ends = [len(head)] if head else []  # the system turn
    ends += [len(head) + j for j in range(2, len(context) + 1, 2)]  # each entry
    found = [_prefix_len(ids, render_ids(tokenizer, whole[:i], add_generation_prompt=False)) for i in ends]
    if not context:  # entries' blocks were stored without this cut: only entry-less prompts take it
        found.append(_prefix_len(ids, preamble(tokenizer)))
    first_turn = len(head) + len(context)
    found += [_prefix_len(ids, render_ids(tokenizer, whole[:i], add_generation_prompt=True))
              for i in range(first_turn, len(whole)) if whole[i]["role"] == "assistant"]
    return Layout(ids, _cuts(found + [len(ids)], len(ids)))


def question_layout(tokenizer, question: str, entries: Sequence = (), answer_prefix_ids: Sequence[int] = ()) -> Layout:
    """The prompt `answer` computes: the entries' conversation (if any) and the question, with the
    assistant's turn opened by `answer_prefix_ids` when given; cut at each entry's end and, when an answer
    prefix follows, at the question's end (the assistant's turn opened): where the blocks are stored (a
    server's `cache`, `block_policy`), the same question asked again grafts all of it and computes only
    the prefix, as a chat's next turn grafts the last one's prompt. Without a prefix the question's end is
    the prompt's own: its last token is always computed, so no block could end there."""
    if entries:
        chat = chat_layout(tokenizer, [{"role": "user", "content": question}], entries)
        ids, cuts = chat.ids, chat.cuts if answer_prefix_ids else chat.cuts[:-1]
    else:
        ids = render_ids(tokenizer, [{"role": "user", "content": question}], add_generation_prompt=True)
        cuts = _cuts([_prefix_len(ids, preamble(tokenizer)), len(ids) if answer_prefix_ids else None], len(ids))
    return Layout(ids + list(answer_prefix_ids), cuts)


def entry_probe(tokenizer, entry_ids: Sequence[int], problem: str, solution: str, answer: str | None) -> Layout:
    """An entry's ids followed by `PROBE_QUESTION` (as a follow-up renders it), cut at the entry's end:
    what `remember` computes to store the entry's blocks (every chunk of its ids, the tail one too) and to
    prove them, grafted, against a recompute."""
    follow = continuation_ids(tokenizer, entry_messages(problem, solution, answer),
                              [{"role": "user", "content": PROBE_QUESTION}])
    if follow is None:  # a template that does not extend the entry's rendering: the plain layout's question
        follow = list(tokenizer(f"Question: {PROBE_QUESTION}\n\nAnswer:", add_special_tokens=False)["input_ids"])
    return Layout(list(entry_ids) + list(follow), (len(entry_ids),))


__all__ = ["Layout", "PROBE_QUESTION", "chat_layout", "entry_probe", "question_layout"]
