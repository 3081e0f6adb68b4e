"""kvmemory: exact KV-cache grafting memory for agents on frozen Hugging Face models.

The public API, everything users and the framework integrations need:

    from kvmemory import KVMemory
    mem = KVMemory()                                   # embedded SmolLM2-135M-Instruct, default store
    entry = mem.remember(problem, solution, answer="31")
    ans = mem.answer("a reworded question ...", answer_prefix="The answer is", choices="numbers")
    mem.verify()                                       # graft vs recompute: SHA-256, KL = 0, argmax 100 %

- the facade: `KVMemory` and its results (`Answer`, `Recalled`, `VerifySummary`, `EntryRecord`), listing
  and history (`EntryPage`, `EntryVersion`), metadata filters (`matches`, `check_where`), deferred writes
  (`PendingWrite`);
- the engine underneath: `Engine`, `GraftReport`, `VerifyReport`, `ForwardResult`, `Sampling`,
  `ExecutionProfile`, `load_model`; where a model runs (`resolve_device`, `resolve_dtype`: "auto", "cpu",
  "cuda", "cuda:N"; `DeviceUnavailable`);
- stores: `open_store` and the `Store` protocol (`LocalStore`, `SignedLocalStore`, `RedisStore`);
  portable bundles (`KVMemory.export_bundle` / `import_bundle`, `read_bundle`, `ExportReport`, `ImportReport`);
- verifiers (`verifier_by_name`, `ArithmeticVerifier`, ...) and the typed errors (`KVMemoryError` ...);
- for framework adapters (kvmemory.adapters, what the LangChain and LlamaIndex integrations share):
  one memory per model and store in a process (`shared_memory`, `borrow_memory`, `memory_lock`),
  messages as chat-template turns and the tool-call protocol (`Message`, `to_turns`, ...), one chat call
  with guided decoding (`ChatRequest`, `run_chat`, `Decoder`, `JsonGuide`), streaming that stops when its
  consumer goes away (`stream_text`, `astream_text`); token counts through the model's own tokenizer,
  without loading the model (`tokenizer_for`, `count_tokens`, `count_chat_tokens`, ...).

Names are imported on first use, so `import kvmemory` (and `kvmemory --help`) stays quick; the
layers underneath (kvmemory.engine, .store, ...) are internals and may change between versions.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING

try:
    __version__ = importlib.metadata.version("kvmemory")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# public name -> the module that defines it
_EXPORTS = {
    # the facade and its results
    "KVMemory": "kvmemory.memory.facade",
    "Answer": "kvmemory.memory.facade",
    "ChatPrompt": "kvmemory.memory.facade",
    "Recalled": "kvmemory.memory.facade",
    "VerifySummary": "kvmemory.memory.facade",
    "TEXT_TEMPLATE": "kvmemory.memory.facade",
    "DEFAULT_NAMESPACE": "kvmemory.memory.facade",
    "KEEP": "kvmemory.memory.facade",
    "EntryPage": "kvmemory.memory.listing",
    "EntryVersion": "kvmemory.memory.listing",
    "PendingWrite": "kvmemory.memory.background",
    "matches": "kvmemory.memory.filters",
    "check_where": "kvmemory.memory.filters",
    "render_ids": "kvmemory.memory.prompts",
    "solution_text": "kvmemory.memory.prompts",
    # verifiers
    "Verifier": "kvmemory.memory.verifiers",
    "VerifierResult": "kvmemory.memory.verifiers",
    "ExactAnswerVerifier": "kvmemory.memory.verifiers",
    "ArithmeticVerifier": "kvmemory.memory.verifiers",
    "NoneVerifier": "kvmemory.memory.verifiers",
    "NoteVerifier": "kvmemory.memory.verifiers",
    "is_note": "kvmemory.memory.verifiers",
    "kind_of": "kvmemory.memory.verifiers",
    "AddResult": "kvmemory.memory.notes",
    "NOTE_TEMPLATE": "kvmemory.memory.notes",
    "VERIFIERS": "kvmemory.memory.verifiers",
    "verifier_by_name": "kvmemory.memory.verifiers",
    "extract_answer": "kvmemory.memory.verifiers",
    "extract_value": "kvmemory.memory.verifiers",
    "numbers_in": "kvmemory.memory.verifiers",
    # the engine
    "Engine": "kvmemory.engine.engine",
    "VerifyReport": "kvmemory.engine.engine",
    "GraftReport": "kvmemory.engine.graft",
    "ForwardResult": "kvmemory.engine.runner",
    "Sampling": "kvmemory.engine.runner",
    "GREEDY": "kvmemory.engine.runner",
    "DEFAULT_CHUNK": "kvmemory.engine.runner",
    "ExecutionProfile": "kvmemory.engine.profile",
    "load_model": "kvmemory.models.loading",
    "resolve_device": "kvmemory.models.devices",
    "resolve_dtype": "kvmemory.models.devices",
    "LoadedModel": "kvmemory.models.loading",
    "DEFAULT_MODEL": "kvmemory.models.loading",
    # stores
    "Store": "kvmemory.store.protocol",
    "open_store": "kvmemory.store.open",
    "LocalStore": "kvmemory.store.local",
    "EntryRecord": "kvmemory.store.local",
    "StoreStats": "kvmemory.store.local",
    "SignedLocalStore": "kvmemory.store.signing",
    "Signer": "kvmemory.store.signing",
    "RedisStore": "kvmemory.store.redis_store",
    # portable bundles (kvmemory export / import)
    "Bundle": "kvmemory.store.bundle",
    "ExportReport": "kvmemory.store.bundle",
    "read_bundle": "kvmemory.store.bundle",
    "write_bundle": "kvmemory.store.bundle",
    "ImportReport": "kvmemory.memory.transfer",
    # what the framework adapters share (kvmemory.adapters)
    "shared_memory": "kvmemory.adapters.shared",
    "memory_lock": "kvmemory.adapters.shared",
    "share_steps": "kvmemory.adapters.shared",
    "SharedMemory": "kvmemory.adapters.shared",
    "borrow_memory": "kvmemory.adapters.shared",
    "env_store": "kvmemory.adapters.shared",
    "Message": "kvmemory.adapters.messages",
    "to_turns": "kvmemory.adapters.messages",
    "template_role": "kvmemory.adapters.messages",
    "text_of": "kvmemory.adapters.messages",
    "normalize_tool_choice": "kvmemory.adapters.messages",
    "parse_tool_calls": "kvmemory.adapters.messages",
    "render_tool_call": "kvmemory.adapters.messages",
    "TOOL_CALL_OPEN": "kvmemory.adapters.messages",
    "TOOL_CALL_CLOSE": "kvmemory.adapters.messages",
    "Decoder": "kvmemory.adapters.guided",
    "DecodeStats": "kvmemory.adapters.guided",
    "JsonGuide": "kvmemory.adapters.guided",
    "call_tool": "kvmemory.adapters.guided",
    "ChatRequest": "kvmemory.adapters.chat",
    "ChatOutcome": "kvmemory.adapters.chat",
    "run_chat": "kvmemory.adapters.chat",
    "TOOL_POLICIES": "kvmemory.adapters.chat",
    "stream_text": "kvmemory.adapters.streaming",
    "astream_text": "kvmemory.adapters.streaming",
    "StreamChunk": "kvmemory.adapters.streaming",
    "VisibleText": "kvmemory.adapters.streaming",
    "StreamCancelled": "kvmemory.adapters.streaming",
    "UnsupportedContent": "kvmemory.adapters.errors",
    "ToolChoiceError": "kvmemory.adapters.errors",
    "GuidedDecodingError": "kvmemory.adapters.errors",
    "UnknownOption": "kvmemory.adapters.errors",
    "max_tokens_option": "kvmemory.adapters.options",
    "prompt_text": "kvmemory.adapters.options",
    "sampling_option": "kvmemory.adapters.options",
    "tokenizer_for": "kvmemory.adapters.tokens",
    "encode_text": "kvmemory.adapters.tokens",
    "count_tokens": "kvmemory.adapters.tokens",
    "chat_token_ids": "kvmemory.adapters.tokens",
    "count_chat_tokens": "kvmemory.adapters.tokens",
    # data for evaluations (seeded word problems with worked solutions, rewordings, unrelated questions)
    "generate_problems": "kvmemory.bench.problems",
    "unrelated_questions": "kvmemory.bench.problems",
    # errors
    "KVMemoryError": "kvmemory.errors",
    "InvalidInput": "kvmemory.errors",
    "DeviceUnavailable": "kvmemory.errors",
    "ProfileMismatch": "kvmemory.errors",
    "NotOnGrid": "kvmemory.errors",
    "IntegrityError": "kvmemory.errors",
    "BundleError": "kvmemory.errors",
    "UnsupportedArchitecture": "kvmemory.errors",
    "UnsupportedModel": "kvmemory.errors",
    "StoreError": "kvmemory.errors",
    "StoreFormatError": "kvmemory.errors",
    "StoreReadOnly": "kvmemory.errors",
    "StoreFull": "kvmemory.errors",
    "UnknownEntry": "kvmemory.errors",
    "UnknownModel": "kvmemory.errors",
    "VerificationFailed": "kvmemory.errors",
    "RouterMismatch": "kvmemory.errors",
    "GraphCaptureError": "kvmemory.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmemory' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # what type checkers and IDEs see (py.typed): the same names, imported eagerly
    from kvmemory.adapters.chat import TOOL_POLICIES, ChatOutcome, ChatRequest, run_chat
    from kvmemory.adapters.errors import GuidedDecodingError, ToolChoiceError, UnknownOption, UnsupportedContent
    from kvmemory.adapters.options import max_tokens_option, prompt_text, sampling_option
    from kvmemory.adapters.guided import DecodeStats, Decoder, JsonGuide, call_tool
    from kvmemory.adapters.messages import (TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Message, normalize_tool_choice,
                                            parse_tool_calls, render_tool_call, template_role, text_of, to_turns)
    from kvmemory.adapters.shared import SharedMemory, borrow_memory, env_store, memory_lock, shared_memory
    from kvmemory.adapters.streaming import StreamCancelled, StreamChunk, VisibleText, astream_text, stream_text
    from kvmemory.adapters.tokens import chat_token_ids, count_chat_tokens, count_tokens, encode_text, tokenizer_for
    from kvmemory.bench.problems import generate_problems, unrelated_questions
    from kvmemory.engine.engine import Engine, VerifyReport
    from kvmemory.engine.graft import GraftReport
    from kvmemory.engine.profile import ExecutionProfile
    from kvmemory.engine.runner import DEFAULT_CHUNK, GREEDY, ForwardResult, Sampling
    from kvmemory.errors import (BundleError, DeviceUnavailable, GraphCaptureError, IntegrityError, InvalidInput,
                                 KVMemoryError, NotOnGrid, ProfileMismatch,
                                 RouterMismatch, StoreError, StoreFormatError, StoreFull, StoreReadOnly,
                                 UnknownEntry, UnsupportedArchitecture, UnsupportedModel,
                                 VerificationFailed)
    from kvmemory.memory.background import PendingWrite
    from kvmemory.memory.filters import check_where, matches
    from kvmemory.memory.listing import EntryPage, EntryVersion
    from kvmemory.memory.facade import (KEEP, DEFAULT_NAMESPACE, TEXT_TEMPLATE, Answer, ChatPrompt, KVMemory, Recalled,
                                        VerifySummary)
    from kvmemory.memory.prompts import render_ids, solution_text
    from kvmemory.memory.transfer import ImportReport
    from kvmemory.memory.notes import NOTE_TEMPLATE, AddResult
    from kvmemory.memory.verifiers import (VERIFIERS, ArithmeticVerifier, ExactAnswerVerifier, NoneVerifier,
                                           NoteVerifier, Verifier, VerifierResult, extract_answer, extract_value,
                                           is_note, kind_of, numbers_in, verifier_by_name)
    from kvmemory.models.devices import resolve_device, resolve_dtype
    from kvmemory.models.loading import DEFAULT_MODEL, LoadedModel, load_model
    from kvmemory.store.bundle import Bundle, ExportReport, read_bundle, write_bundle
    from kvmemory.store.local import EntryRecord, LocalStore, StoreStats
    from kvmemory.store.open import open_store
    from kvmemory.store.protocol import Store
    from kvmemory.store.redis_store import RedisStore
    from kvmemory.store.signing import SignedLocalStore, Signer
