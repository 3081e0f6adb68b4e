"""`KVMemoryBlock`: a memory block for LlamaIndex's `Memory` that gets and puts verified solutions.

get: the latest user message is routed (kvmemory's FAISS router, as `KVMemory.answer` routes: the
calibrated threshold for solutions, the lower note threshold for notes) to stored entries; the
verified solutions and the notes (facts the user stated, kvmemory/memory/notes.py) come back as text
that `Memory` puts in the system message (or the last user message, per its `insert_method`); a note
reads "Note: <statement>" (`note_template`).

put: `Memory` hands a block the messages it flushes out of its short-term queue; they go to
`KVMemory.add` (a fixed rule, no model). A user message that asks something (a question or a
request) followed by an assistant reply is a (problem, solution) pair, stored only if the block's
verifier accepts it (kvmemory runs the verifier before any KV is computed), so the block never turns
an unchecked chat reply into a "verified solution". The answer, when the caller knows it, rides on
the assistant message as `additional_kwargs["answer"]`. Pairs the verifier refuses are recorded in
`rejected`, not raised: a flush is housekeeping, and one bad reply must not lose the others. A user
message that asks nothing ("My cat is called Tom.") is kept as notes, one per statement
(`include_notes=False` neither stores nor gets them).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

from kvmemory import (DEFAULT_MODEL, TEXT_TEMPLATE, VERIFIERS, EntryRecord, InvalidInput, KVMemory, Recalled,
                      VerificationFailed, borrow_memory, is_note, prompt_text, shared_memory)
from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock
from llama_index.core.bridge.pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator
from llama_index.core.memory.memory import BaseMemoryBlock

DEFAULT_FORMAT = TEXT_TEMPLATE
DEFAULT_NOTE_FORMAT = "Note: {problem}"
# Between two solutions in the block's text; truncation cuts at these.
SEPARATOR = "\n\n"


@dataclass(slots=True, frozen=True)
class Rejected:
    """A (problem, solution) pair the block did not store, and why."""

    problem: str
    solution: str
    answer: str | None
    reason: str


def _text(message: ChatMessage) -> str:
    return "".join(b.text for b in message.blocks if isinstance(b, TextBlock))


def _check_messages(messages: Any) -> None:
    if messages is None:
        return
    if not isinstance(messages, list) or not all(isinstance(m, ChatMessage) for m in messages):
        raise InvalidInput(f"messages must be a list of llama_index ChatMessage objects, got {messages!r:.80}")


class KVMemoryBlock(BaseMemoryBlock[str]):
    """Verified solutions from a kvmemory store, as a `Memory` block.

    Pass a shared `memory` (`kvmemory.KVMemory`), or `store` (and `model`, `device`, `dtype`: as
    kvmemory.KVMemory's) to open one.
    """

    name: str = Field(default="verified_solutions", description="The name of the memory block.")
    description: str | None = Field(
        default="Verified solutions to problems like the user's, with their worked steps.",
        description="A description of the memory block.")
    memory: KVMemory = Field(exclude=True, description="The kvmemory store and model.")
    namespace: str | None = Field(default=None,
                                  description="Namespace got from and put into (default: the memory's).")
    similarity_top_k: int = Field(default=2, ge=1, description="At most this many solutions per get.")
    threshold: float | None = Field(default=None, description="Routing threshold (default: calibrated).")
    verifier: str = Field(default="arithmetic",
                          description="kvmemory verifier that puts must pass: arithmetic, exact-answer or none.")
    include_unverified: bool = Field(default=False, description="Also get solutions stored unverified.")
    include_notes: bool = Field(default=True, description="Keep the user's statements as notes, and get them.")
    answer_key: str = Field(default="answer", description="additional_kwargs key of an assistant message's answer.")
    format_template: str = Field(default=DEFAULT_FORMAT,
                                 description="One solution's text, from `problem`, `solution` and `answer`.")
    note_template: str = Field(default=DEFAULT_NOTE_FORMAT, description="One note's text, from `problem`.")

    _remembered: list[EntryRecord] = PrivateAttr(default_factory=list)
    _rejected: list[Rejected] = PrivateAttr(default_factory=list)

    @field_validator("verifier")
    @classmethod
    def _known_verifier(cls, name: str) -> str:
        if name not in VERIFIERS:
            raise ValueError(f"unknown verifier {name!r}; known: {', '.join(sorted(VERIFIERS))}")
        return name

    @model_validator(mode="before")
    @classmethod
    def _open_memory(cls, values: Any) -> Any:
        if isinstance(values, dict) and values.get("memory") is None:
            values = dict(values)
            store = values.pop("store", None)
            model = values.pop("model", DEFAULT_MODEL)
            values["memory"] = shared_memory(model, store)
        elif isinstance(values, dict):
            values = {k: v for k, v in values.items() if k not in ("store", "model")}
        return values

    def __init__(self, memory: KVMemory | None = None, *, store: str | os.PathLike[str] | None = None,
                 model: str = DEFAULT_MODEL, device: str = "auto", dtype: str = "auto", **kwargs: Any) -> None:
        if memory is None or isinstance(memory, KVMemory):  # opened here: a bad device raises its own typed error
            memory = borrow_memory(memory, model, store, device=device, dtype=dtype).memory
        try:
            super().__init__(memory=memory, store=store, model=model, **kwargs)
        except ValidationError as exc:
            # pydantic's error for a bad field (similarity_top_k=0, a memory that is not a KVMemory, an
            # unknown verifier) as kvmemory's typed one; both are ValueErrors.
            raise InvalidInput(f"KVMemoryBlock: {exc}") from exc

    @property
    def remembered(self) -> list[EntryRecord]:
        """Entries this block stored, oldest first."""
        return list(self._remembered)

    @property
    def rejected(self) -> list[Rejected]:
        """Pairs this block was given but did not store, oldest first."""
        return list(self._rejected)

    # ------------------------------------------------------------------ get
    def recall(self, query: str) -> list[Recalled]:
        """The solutions and notes a get would return for `query`, best first."""
        query = prompt_text(query, "query")
        if not query.strip():
            return []
        hits = self.memory.route(query, k=self.similarity_top_k, namespace=self.namespace, threshold=self.threshold)
        return [h for h in hits
                if (self.include_notes if is_note(h.entry) else (self.include_unverified or h.entry.verified))]

    def _format(self, hits: list[Recalled]) -> str:
        return SEPARATOR.join(h.text(self.format_template, self.note_template).strip() for h in hits)

    async def _aget(self, messages: list[ChatMessage] | None = None, **block_kwargs: Any) -> str:
        _check_messages(messages)
        query = next((_text(m) for m in reversed(messages or []) if m.role == MessageRole.USER), "")
        if not query.strip():
            return ""
        # Embedding the query and reading the catalogue block: keep the event loop free.
        hits = await asyncio.to_thread(self.recall, query)
        return self._format(hits)

    async def atruncate(self, content: str, tokens_to_truncate: int) -> str | None:
        """Drop whole solutions from the end (the lowest scored) until about `tokens_to_truncate`
        tokens are gone; a solution is never cut in half."""
        if content is not None:
            content = prompt_text(content, "content")
        if isinstance(tokens_to_truncate, bool) or not isinstance(tokens_to_truncate, int):
            raise InvalidInput(f"tokens_to_truncate must be an integer, got {tokens_to_truncate!r}")
        parts = content.split(SEPARATOR) if content else []
        tok = self.memory.engine.tokenizer
        while parts and tokens_to_truncate > 0:
            tokens_to_truncate -= len(tok(parts.pop() + SEPARATOR, add_special_tokens=False)["input_ids"])
        return SEPARATOR.join(parts) or None

    # ------------------------------------------------------------------ put
    def remember(self, problem: str, solution: str, answer: str | None = None) -> EntryRecord | None:
        """Store one pair if the verifier accepts it; returns the entry, or None (see `rejected`).
        A problem, solution or answer that is not a string is a caller's mistake: InvalidInput, raised."""
        prompt_text(problem, "problem"), prompt_text(solution, "solution")
        if answer is not None:
            prompt_text(answer, "answer")
        try:
            entry = self.memory.remember(problem, solution, answer, verifier=self.verifier, namespace=self.namespace)
        except (VerificationFailed, InvalidInput) as e:
            self._rejected.append(Rejected(problem, solution, answer, str(e)))
            return None
        self._remembered.append(entry)
        return entry

    def _chat(self, messages: list[ChatMessage]) -> list[dict]:
        """The messages as `KVMemory.add` reads them (user and assistant turns; an answer on a reply)."""
        out = []
        for m in messages:
            role = {MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant"}.get(m.role, "other")
            answer = m.additional_kwargs.get(self.answer_key) if role == "assistant" else None
            out.append({"role": role, "content": _text(m),
                        "answer": None if answer is None else str(answer)})
        return out

    def put_chat(self, messages: list[ChatMessage]) -> None:
        """What a flush stores (module docstring): verified pairs, and the user's statements as notes."""
        _check_messages(messages)
        result = self.memory.add(self._chat(messages), namespace=self.namespace, verifier=self.verifier,
                                 facts=self.include_notes)
        self._remembered.extend(result.entries)
        self._rejected.extend(Rejected(s["problem"], s["solution"], s["answer"], s["reason"]) for s in result.skipped)

    async def _aput(self, messages: list[ChatMessage]) -> None:
        # Remembering runs the model over each pair and note (seconds on a CPU): off the event loop.
        await asyncio.to_thread(self.put_chat, messages)
