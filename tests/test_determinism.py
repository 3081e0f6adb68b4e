"""An engine pins torch's process-wide settings only while it computes, and puts back the caller's."""

from __future__ import annotations

import threading

import torch
from tiny_models import IdTokenizer, tiny_model

from kvmemory.engine.determinism import Determinism
from kvmemory.engine.engine import Engine
from kvmemory.models.loading import LoadedModel
from kvmemory.store.local import LocalStore


def _settings() -> tuple:
    return (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads(),
            torch.get_float32_matmul_precision())


def test_engine_leaves_the_callers_torch_settings_as_they_were(tmp_path):
    before = _settings()
    threads = 1 if torch.get_num_threads() != 1 else 2
    eng = Engine(LoadedModel(tiny_model("llama", torch.float32, 0), IdTokenizer(), "tiny", "tiny"),
                 LocalStore(tmp_path), chunk=16, threads=threads)
    assert _settings() == before  # constructing changed nothing
    seen = []
    ids = list(range(3, 60))
    eng.store_prefix(ids[:48])
    result, report = eng.forward(ids, max_new_tokens=2, on_token=lambda t: seen.append(_settings()) and False)
    assert _settings() == before  # nor did computing
    assert report.tokens_grafted == 48
    # ... while inside the call the engine's own settings were in force, and the profile says so
    assert seen and all(s == (True, threads, "highest") for s in seen)
    assert eng.profile.threads == threads and '"deterministic_algorithms":true' in eng.profile.deterministic


def test_settings_are_restored_when_the_call_raises():
    before = _settings()
    d = Determinism("cpu", 1 if torch.get_num_threads() != 1 else 2)
    try:
        with d.applied():
            assert torch.are_deterministic_algorithms_enabled()
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert _settings() == before


def test_two_threads_do_not_see_each_others_settings():
    """Applied scopes are serialised: a thread never runs inside another engine's thread count."""
    inside = threading.Event()
    release = threading.Event()
    order = []

    def first():
        with Determinism("cpu", 1).applied():
            order.append("first in")
            inside.set()
            release.wait(5)
            order.append("first out")

    def second():
        inside.wait(5)
        with Determinism("cpu", 2).applied():
            order.append("second in")

    a, b = threading.Thread(target=first), threading.Thread(target=second)
    a.start(), b.start()
    inside.wait(5)
    release.set()
    a.join(10), b.join(10)
    assert order == ["first in", "first out", "second in"]
