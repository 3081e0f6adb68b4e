"""The batched step (engine/batched_step.py, engine/batch.py): every sequence of a batch gets the bits it
gets alone (torch.equal on every prefill and decode logit), for batches of 1, 2, 4, 8 and 16 mixing
grafted and cold, short and long sequences, on the embedded model and the tiny architecture matrix."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
from gguf_files import write_tiny_gguf
from tiny_models import ARCHS, tiny_engine

from kvmemory.engine.batched_step import GRAIN, BatchedStep, StepItem, why_not
from kvmemory.engine.engine import Engine
from kvmemory.kernels import quantized_linear
from kvmemory.store.local import LocalStore

SIZES = (1, 2, 4, 8, 16)


def _pool(eng: Engine, chunk: int, vocab: int, seed: int = 0) -> list[dict]:
    """16 requests: short and long prompts, some of whose prefixes are stored (grafted), some cold, with
    different numbers of tokens to decode (so sequences leave the batch at different steps), some in
    logits="last" mode (what answering computes)."""
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab) for _ in range(5 * chunk)]
    eng.store_prefix(base[: 3 * chunk])  # a shared stored prefix: long prompts that start with it graft it
    other = [rng.randrange(3, vocab) for _ in range(2 * chunk)]
    eng.store_prefix(other)
    reqs = []
    for i in range(16):
        kind = i % 4
        if kind == 0:  # short, cold
            ids = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, chunk // 2 + 2))]
        elif kind == 1:  # long, grafted from the shared prefix
            ids = base[: 3 * chunk] + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 2 * chunk))]
        elif kind == 2:  # long, cold (the same prefix, not grafted)
            ids = base[: rng.randrange(chunk + 1, 5 * chunk)]
        else:  # a graft of the other stored prefix, a short tail
            ids = other + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 5))]
        req = dict(token_ids=ids, graft=kind != 2, max_new_tokens=rng.randrange(0, 7), stop_token_ids=(),
                   keep_logits=True)
        if i % 5 == 4:
            req.update(logits="last", keep_logits=False)
        reqs.append(req)
    return reqs


def _check(eng: Engine, reqs: list[dict], budget: int, late: bool = True) -> None:
    alone = [eng.forward(**r) for r in reqs]
    for size in SIZES:
        chosen = reqs[:size]
        batch = eng.batch(budget)
        first = chosen if not late else chosen[: (size + 1) // 2]
        seqs = [batch.add(**r) for r in first]
        if late:  # the others join two steps later, while the first are running
            batch.step()
            batch.step()
            seqs += [batch.add(**r) for r in chosen[len(first):]]
        widest = batch.last_rows
        while batch.step():
            widest = max(widest, batch.last_rows)
        assert size < 4 or widest > 2  # the sequences really shared steps
        for i, s in enumerate(seqs):
            ref, ref_report = alone[i]
            got = s.result
            assert s.error is None, s.error
            assert got.generated == ref.generated, (size, i)
            assert got.logits_sha256 == ref.logits_sha256, (size, i)
            assert got.argmax == ref.argmax
            assert got.stopped_by == ref.stopped_by
            assert s.report.tokens_grafted == ref_report.tokens_grafted
            if ref.prefill_logits is not None:
                assert torch.equal(got.prefill_logits, ref.prefill_logits), (size, i)
                assert torch.equal(got.decode_logits, ref.decode_logits), (size, i)
        assert not batch.sequences  # every sequence left when done
    assert any(r.tokens_grafted for _, r in alone) and any(not r.tokens_grafted for _, r in alone)


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return {arch: write_tiny_gguf(folder / f"{arch}.gguf", arch, linear_type="Q8_0")[0] for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_row_equals_its_sequence_alone_across_the_matrix(arch, tiny_ggufs, tmp_path):
    eng = Engine.open(str(tiny_ggufs[arch]), tmp_path / "store", chunk=16)
    if arch in ("llama", "mistral", "qwen2"):  # the lean step over GGUF blocks: rows share the step
        assert why_not(eng.runner) is None
    else:
        assert why_not(eng.runner) is not None
    _check(eng, _pool(eng, 16, eng.runner.vocab_size), budget=40)


@pytest.mark.parametrize("kind", sorted(quantized_linear.FORMATS))
def test_block_types_batch_exactly(kind, tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", linear_type=kind, embedding_type=kind, seed=1)[0]
    eng = Engine.open(str(path), tmp_path / "store", chunk=16)
    assert why_not(eng.runner) is None
    _check(eng, _pool(eng, 16, eng.runner.vocab_size, seed=1)[:8], budget=64, late=False)


def test_torch_linears_run_one_at_a_time_and_still_equal(store_dir):
    """oneDNN / torch GEMMs change their reduction with the row count: no sharing, the same answers."""
    eng = tiny_engine("llama", store_dir)
    reason = why_not(eng.runner)
    assert reason is not None and "GGUF" in reason
    _check(eng, _pool(eng, 16, 512)[:8], budget=40, late=False)


def test_the_embedded_model_batches_exactly(smollm, tmp_path):
    eng = Engine(smollm, LocalStore(tmp_path / "store"))
    assert why_not(eng.runner) is None, why_not(eng.runner)
    _check(eng, _pool(eng, 64, eng.runner.vocab_size, seed=3), budget=256)


def test_the_row_kernels_are_row_count_invariant(smollm, tmp_path):
    """What the shared step relies on, measured: the GGUF-block linears and the norm kernel give a row
    the same bits whatever rows share the call (1 to 80 rows)."""
    eng = Engine(smollm, LocalStore(tmp_path / "store"))
    lean = eng.runner._lean_step
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 80, smollm.model.config.hidden_size, generator=g)
    with eng.determinism.applied(), torch.inference_mode():
        for lin in (lean.qkv[0], lean.gate_up[3], smollm.model.lm_head):
            whole = lin.forward(x)
            for r in (1, 2, 16, 21, 80):
                assert torch.equal(lin.forward(x[:, :r]), whole[:, :r])
            assert torch.equal(lin.forward(x[:, 37:38]), whole[:, 37:38])
        norm = lean.layers[0].input_layernorm
        scratch = torch.empty(x.shape[-1])
        whole = lean._norm(norm, x.clone(), None, scratch)
        for r in (1, 5, 80):
            assert torch.equal(lean._norm(norm, x[:, :r].clone(), None, scratch), whole[:, :r])


def test_a_cancelled_sequence_leaves_at_once_and_the_others_are_unchanged(tmp_path, tiny_ggufs):
    eng = Engine.open(str(tiny_ggufs["llama"]), tmp_path / "store", chunk=16)
    reqs = _pool(eng, 16, eng.runner.vocab_size)[:4]
    for r in reqs:
        r["max_new_tokens"] = 6
    alone = [eng.forward(**r)[0] for r in reqs]
    batch = eng.batch(64)
    seqs = [batch.add(**r) for r in reqs]
    batch.step()
    batch.cancel(seqs[1])
    assert seqs[1] not in batch.sequences and seqs[1].cache is None
    batch.run()
    for i in (0, 2, 3):
        assert torch.equal(seqs[i].result.all_logits(), alone[i].all_logits())
    assert seqs[1].result is None and seqs[1].cancelled


def test_the_step_plan_puts_decode_rows_first_within_the_budget(tmp_path, tiny_ggufs):
    eng = Engine.open(str(tiny_ggufs["llama"]), tmp_path / "store", chunk=16)
    batch = eng.batch(20)
    a = batch.add(list(range(3, 8)), graft=False, max_new_tokens=4)
    batch.step()  # a's prompt: 5 tokens
    b = batch.add(list(range(3, 60)), graft=False, max_new_tokens=2)
    c = batch.add(list(range(3, 40)), graft=False, max_new_tokens=2)
    plan = batch.plan()
    assert plan[0] == (a, 5, 6)  # a's decode row first
    assert plan[1] == (b, 0, 16)  # then b's first chunk; c's would pass the budget (1 + 16 + 16 > 20)
    assert len(plan) == 2
    batch.run()
    assert a.result and b.result and c.result


def test_sampled_sequences_batch_exactly(tmp_path, tiny_ggufs):
    from kvmemory.engine.runner import Sampling

    eng = Engine.open(str(tiny_ggufs["llama"]), tmp_path / "store", chunk=16)
    reqs = [dict(token_ids=list(range(5 + i, 30 + 3 * i)), graft=False, max_new_tokens=5, stop_token_ids=(),
                 keep_logits=True, sampling=Sampling(temperature=0.8, top_k=20, seed=i)) for i in range(4)]
    alone = [eng.forward(**r)[0] for r in reqs]
    got = eng.forward_many(reqs, token_budget=64)
    for (res, _), ref in zip(got, alone):
        assert res.generated == ref.generated and torch.equal(res.all_logits(), ref.all_logits())


def test_step_items_alone_equal_the_runner_step():
    assert GRAIN == 32768
    assert BatchedStep and StepItem


def test_the_static_step_runs_one_sequence_at_a_time_and_still_equals(store_dir):
    """One cache for one sequence (static_step.py): the batch runs its sequences first come, first served."""
    eng = tiny_engine("llama", store_dir, step="static")
    assert "one cache" in why_not(eng.runner)
    reqs = _pool(eng, 16, 512, seed=4)[:4]
    alone = [eng.forward(**r) for r in reqs]
    batch = eng.batch(64)
    seqs = [batch.add(**r) for r in reqs]
    while batch.step():
        assert batch.last_rows == 1
    for s, (ref, _) in zip(seqs, alone):
        assert s.result.logits_sha256 == ref.logits_sha256 and s.result.generated == ref.generated


@pytest.mark.skipif(os.environ.get("ATEN_CPU_CAPABILITY") == "avx2", reason="this run is the AVX2 one")
def test_the_avx2_builds_batch_exactly_too():
    """The other ISA build (torch told to run AVX2, so native.py picks the kernels' AVX2 builds)."""
    from kvmemory.kernels import native

    if not native.runs("AVX2"):
        pytest.skip("this CPU runs no AVX2")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "matrix and (llama or qwen2) or block_types"], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(__file__), timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_a_sequence_past_the_kv_budget_waits_for_room(tmp_path, tiny_ggufs):
    from kvmemory.engine.batch import Batch

    eng = Engine.open(str(tiny_ggufs["llama"]), tmp_path / "store", chunk=16)
    batch = Batch(eng, 64, kv_tokens=40)
    a = batch.add(list(range(3, 30)), graft=False, max_new_tokens=5)  # 32 positions
    b = batch.add(list(range(3, 20)), graft=False, max_new_tokens=5)  # 22 more: past 40, so it waits
    batch.step()
    assert a.prepared and not b.prepared
    batch.run()
    assert a.result is not None and b.result is not None
    assert b.result.logits_sha256 == eng.forward(list(range(3, 20)), graft=False, max_new_tokens=5)[0].logits_sha256


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_decode_rows_plan_is_kept_and_rebuilt_when_its_cache_changes(arch, tmp_path, tiny_ggufs, monkeypatch):
    """A decode row's C arguments are kept on its cache from step to step (batched_step._RowPlan); a
    cache written by anything else since (here: every layer's buffers moved to a larger copy, as a
    reservation that runs out of room does) gets a new plan, so K/V are written where attention reads.
    Steps of several sequences, prefill chunks (the first, on an empty cache, causal) beside decode rows
    too, take the C layer loop (kvm_decode_rows_layer), and give each row its bits alone (qwen2: q/k/v
    biases)."""
    from kvmemory.engine.batched_step import PLAN_ATTR, BatchedStep

    c_steps = []
    rows_layers = BatchedStep._rows_layers
    monkeypatch.setattr(BatchedStep, "_rows_layers",  # each C step's rows per sequence
                        lambda self, *a: c_steps.append([r.T for r in a[2]]) or rows_layers(self, *a))

    eng = Engine.open(str(tiny_ggufs[arch]), tmp_path / "store", chunk=16)
    rng = random.Random(5)
    reqs = [dict(token_ids=[rng.randrange(3, eng.runner.vocab_size) for _ in range(20 + 9 * i)], graft=False,
                 max_new_tokens=8, stop_token_ids=(), keep_logits=True) for i in range(3)]
    alone = [eng.forward(**r)[0] for r in reqs]
    batch = eng.batch(40)
    seqs = [batch.add(**r) for r in reqs]
    while not all(s.decoding for s in seqs):
        batch.step()
    batch.step()
    plans = [getattr(s.cache, PLAN_ATTR) for s in seqs]
    batch.step()
    assert all(getattr(s.cache, PLAN_ATTR) is p for s, p in zip(seqs, plans))  # kept
    moved = seqs[1].cache
    for layer in moved.layers:
        n = layer.get_seq_length()
        layer._reserve(layer.keys, layer.values, n, 2 * layer.k_buf.shape[-2])
        layer.filled(n)
    batch.step()
    assert getattr(moved, PLAN_ATTR) is not plans[1]  # built again over the new buffers
    assert getattr(seqs[0].cache, PLAN_ATTR) is plans[0]
    while batch.step():
        pass
    for s, ref in zip(seqs, alone):
        assert s.result.generated == ref.generated
        assert s.result.logits_sha256 == ref.logits_sha256
        assert torch.equal(s.result.prefill_logits, ref.prefill_logits)
        assert torch.equal(s.result.decode_logits, ref.decode_logits)
    # every step of several sequences: the first chunks (on empty caches: causal), the next beside them, the
    # third sequence's beside decode rows, then decode rows only (one sequence left: its own step)
    assert c_steps == [[16, 16], [4, 13, 16], [1, 1, 16], [1, 1, 6]] + [[1, 1, 1]] * 5


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_rows_spread_over_threads_keep_their_bits(threads, tmp_path, tiny_ggufs, monkeypatch):
    """kvm_decode_rows spreads the one-thread decode rows of sequences whose K/V are apart over its team
    (KvmRows.threads; 1: one after another, as before): each row's calls are the same whichever thread
    makes them, so every logit equals its sequence alone either way."""
    from kvmemory.engine import batched_step
    from kvmemory.kernels import decode_ops

    seen, real = [], decode_ops.Rows

    def rows(*args):
        out = real(*args)
        out.threads = threads  # the team, whatever torch's count
        return out

    eng = Engine.open(str(tiny_ggufs["llama"]), tmp_path / "store", chunk=16)  # the kernels' argtypes: the real Rows
    rows_layers = BatchedStep._rows_layers
    monkeypatch.setattr(batched_step.decode_ops, "Rows", rows)
    monkeypatch.setattr(BatchedStep, "_rows_layers", lambda self, *a: seen.append(
        (a[1].threads, sum(r.T == 1 and r.threads == 1 for r in a[2]))) or rows_layers(self, *a))
    rng = random.Random(11)
    reqs = [dict(token_ids=[rng.randrange(3, eng.runner.vocab_size) for _ in range(5 + 7 * i)], graft=False,
                 max_new_tokens=6, stop_token_ids=(), keep_logits=True) for i in range(5)]
    alone = [eng.forward(**r)[0] for r in reqs]
    batch = eng.batch(64)
    seqs = [batch.add(**r) for r in reqs]
    batch.run()
    assert max(n for t, n in seen if t == threads) >= 4  # steps of several one-thread decode rows in C
    for s, ref in zip(seqs, alone):
        assert s.result.logits_sha256 == ref.logits_sha256
        assert torch.equal(s.result.prefill_logits, ref.prefill_logits)
        assert torch.equal(s.result.decode_logits, ref.decode_logits)


@pytest.mark.parametrize("arch,way", [("llama", "c"), ("qwen2", "c"), ("llama", "python"), ("llama", "copies")])
def test_choices_scored_in_one_shared_step_equal_each_scored_alone(arch, way, tmp_path, tiny_ggufs, monkeypatch):
    """`Engine.choose` scores every choice (here each its own run) in one shared step (runner.score_choices)
    over the prompt's own cache (each run's K/V written after the prompt's and read before the next run's
    overwrite them: runner.choice_items), its layers in C (kvm_decode_rows_layer, each choice a short
    chunk), or through the step's Python loop ("python"), or each over its own copy of the prompt's K/V
    ("copies"): each score equals the one computed alone over the prompt's cache, grafted or not, and
    (none starting like another) does not depend on the other choices offered."""
    from kvmemory.engine.runner import CanonicalRunner as Runner

    c_steps, caches = [], []
    rows_layers = BatchedStep._rows_layers
    monkeypatch.setattr(BatchedStep, "_rows_layers", lambda self, *a: c_steps.append(1) or rows_layers(self, *a))
    if way == "python":
        monkeypatch.setattr(BatchedStep, "_fast_row", lambda self, *a: None)
        monkeypatch.setattr(BatchedStep, "_fast_chunk", lambda self, *a: None)
    if way == "copies":
        monkeypatch.setattr(Runner, "_choices_in_place", lambda self, *a: False)
    choice_items = Runner.choice_items

    def spy(self, n, cache, choices):
        items = choice_items(self, n, cache, choices)
        caches.append((cache, [it.cache for it in items]))
        return items

    monkeypatch.setattr(Runner, "choice_items", spy)
    eng = Engine.open(str(tiny_ggufs[arch]), tmp_path / "store", chunk=16)
    rng = random.Random(9)
    V = eng.runner.vocab_size
    prompt = [rng.randrange(3, V) for _ in range(37)]
    choices = [[rng.randrange(3, V) for _ in range(k)] for k in (1, 2, 3, 5, 4, 1, 3)]
    eng.store_prefix(prompt[:32])
    best, shared, report = eng.choose(prompt, choices)
    assert report.tokens_grafted == 32 and bool(c_steps) == (way != "python")
    prompt_cache, item_caches = caches[0]
    assert all((c is prompt_cache) == (way != "copies") for c in item_caches)
    stepper = eng.runner._choice_stepper()
    assert stepper.shared
    stepper.shared = False  # one choice after another over the prompt's own cache
    try:
        best2, alone, _ = eng.choose(prompt, choices, graft=False)
    finally:
        stepper.shared = True
    assert shared == alone and best == best2
    _, fewer, _ = eng.choose(prompt, [choices[3], choices[0], choices[2]], graft=False)
    assert fewer == [shared[3], shared[0], shared[2]]


def test_choices_that_start_alike_share_their_rows(tmp_path, tiny_ggufs):
    """Numbers offered as choices start alike (' 3.', ' 32.', ' 37.'): their tokens are stepped as runs
    (runner.choice_runs), a run that another one extends not stepped at all, so 7 choices here need 3 runs.
    The scores are the same bits whether the runs share one step or run one after another, and each
    score is the log-likelihood read from the run that holds the choice's tokens."""
    from kvmemory.engine.runner import choice_runs

    eng = Engine.open(str(tiny_ggufs["llama"]), tmp_path / "store", chunk=16)
    rng = random.Random(11)
    V = eng.runner.vocab_size
    sp, dot, a, b, c = (rng.randrange(3, V) for _ in range(5))
    prompt = [rng.randrange(3, V) for _ in range(29)]
    choices = [[sp, a, dot], [sp, a, b, dot], [sp, b, dot], [sp, a, c, dot], [sp, dot], [dot], [sp, b, dot]]
    assert choice_runs(choices) == [(sp, a, b), (sp, b), (sp, a, c)]
    _, shared, _ = eng.choose(prompt, choices, graft=False)
    stepper = eng.runner._choice_stepper()
    stepper.shared = False  # one run after another over the prompt's own cache
    try:
        _, alone, _ = eng.choose(prompt, choices, graft=False)
    finally:
        stepper.shared = True
    assert shared == alone
    assert shared[2] == shared[6]  # the same choice twice: the same run, the same bits
    # a run's rows depend on the prompt's cache and the run alone, not on the other runs offered beside it
    _, two, _ = eng.choose(prompt, [choices[1], choices[0]], graft=False)
    assert two == [shared[1], shared[0]]
    _, own, _ = eng.choose(prompt, [choices[3]], graft=False)
    assert own == [shared[3]]


def test_choose_prefills_in_the_batch_and_scores_the_same(tmp_path, tiny_ggufs):
    """`Engine.choose` prefills its prompt through `forward`, so with a batcher (kvmemory serve, share_steps)
    the prefill joins the shared steps; the scores are the bits of the same choose with no batcher."""
    from concurrent.futures import ThreadPoolExecutor

    from kvmemory.engine.scheduler import BatchScheduler

    eng = Engine.open(str(tiny_ggufs["llama"]), tmp_path / "store", chunk=16)
    rng = random.Random(11)
    V = eng.runner.vocab_size
    base = [rng.randrange(3, V) for _ in range(32)]
    eng.store_prefix(base)
    prompts = [base + [rng.randrange(3, V) for _ in range(3 + i)] if i % 2 else
               [rng.randrange(3, V) for _ in range(20 + i)] for i in range(6)]
    choices = [[rng.randrange(3, V) for _ in range(k)] for k in (1, 3, 2, 4)]
    alone = [eng.choose(p, choices, graft=i % 2 == 1) for i, p in enumerate(prompts)]
    sched = BatchScheduler(eng)
    eng.batcher = sched
    try:
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda ip: eng.choose(ip[1], choices, graft=ip[0] % 2 == 1), enumerate(prompts)))
    finally:
        eng.batcher = None
        sched.close(30)
    assert sched.steps > 0  # the prefills went through the batch
    for (best, scores, rep), (best2, scores2, rep2) in zip(alone, got):
        assert scores2 == scores and best2 == best
        assert rep2.tokens_grafted == rep.tokens_grafted and rep2.tokens_computed == rep.tokens_computed
    assert any(rep.tokens_grafted for _, _, rep in got)


@pytest.mark.parametrize("shared", [True, False])
def test_choices_scored_in_a_step_shared_with_decode_rows_equal_choose_alone(shared, tmp_path, tiny_ggufs):
    """`Batch.add(choices=)`: a sequence's choices are scored in a step of the batch (beside other
    sequences' decode rows and prompt chunks) instead of in its caller's thread: every score equals
    `Engine.choose` alone, and the other sequences' logits equal their forward alone. Where the step is
    not shared the batch scores them as `runner.score_choices` does, and gets the same bits."""
    eng = Engine.open(str(tiny_ggufs["qwen2"]), tmp_path / "store", chunk=16)
    rng = random.Random(5)
    V = eng.runner.vocab_size
    base = [rng.randrange(3, V) for _ in range(32)]
    eng.store_prefix(base)
    decoding = dict(token_ids=[rng.randrange(3, V) for _ in range(21)], max_new_tokens=6, stop_token_ids=(),
                    keep_logits=True)
    asks = [dict(token_ids=base + [rng.randrange(3, V) for _ in range(5)],
                 choices=[[rng.randrange(3, V) for _ in range(k)] for k in (1, 3, 2, 4)]),
            dict(token_ids=[rng.randrange(3, V) for _ in range(9)], graft=False,
                 choices=[[rng.randrange(3, V) for _ in range(k)] for k in (2, 1, 2)]),
            dict(token_ids=[rng.randrange(3, V) for _ in range(12)], choices=[[7], [9, 4][:1]])]  # one-token
    ref = eng.forward(**decoding)[0]
    alone = [eng.choose(**a) for a in asks]
    batch = eng.batch()
    batch.stepper.shared = shared
    assert batch.scores_choices is shared
    dec = batch.add(**decoding)
    batch.step()  # the decoding sequence's prompt: it decodes from the next step on
    seqs = [batch.add(**a) for a in asks]
    mixed = False
    while batch.active:
        scoring = [s for s in seqs if s.scoring]
        batch.step()
        mixed |= bool(scoring) and dec.decoding and batch.last_rows > len(scoring)
    assert mixed is shared  # the choices' rows shared a step with the decode row
    assert dec.result.logits_sha256 == ref.logits_sha256 and torch.equal(dec.result.decode_logits, ref.decode_logits)
    for s, (best, scores, rep) in zip(seqs, alone):
        assert s.error is None and s.result.extra["choice_scores"] == scores
        assert "cache" not in s.result.extra and s.report.tokens_grafted == rep.tokens_grafted


def test_choose_many_scores_an_answer_and_its_contrast_in_the_same_steps(tmp_path, tiny_ggufs):
    """`Engine.choose_many` (a chat's answer and its contrast, memory/answers.py) with a batcher: both
    prompts and both sets of choices share steps, each result the bits of its `choose` alone; bad
    choices are refused before anything runs."""
    from kvmemory.engine.scheduler import BatchScheduler
    from kvmemory.errors import InvalidInput

    eng = Engine.open(str(tiny_ggufs["llama"]), tmp_path / "store", chunk=16)
    rng = random.Random(13)
    V = eng.runner.vocab_size
    entry = [rng.randrange(3, V) for _ in range(32)]
    eng.store_prefix(entry)
    question = [rng.randrange(3, V) for _ in range(7)]
    choices = [[rng.randrange(3, V) for _ in range(k)] for k in (2, 1, 3)]
    asks = [dict(token_ids=entry + question, choices=choices), dict(token_ids=question, choices=choices, graft=False)]
    alone = [eng.choose(**a) for a in asks]
    own = eng.choose_many(asks)  # no batcher: one after another, the same bits
    assert [(b, s) for b, s, _ in own] == [(b, s) for b, s, _ in alone]
    sched = BatchScheduler(eng)
    eng.batcher = sched
    try:
        got = eng.choose_many(asks)
        steps = sched.steps
        with pytest.raises(InvalidInput, match="at least one token"):
            eng.choose_many([asks[0], dict(token_ids=question, choices=[[3], []])])
        with pytest.raises(InvalidInput, match="no choices"):
            eng.choose(question, [])
    finally:
        eng.batcher = None
        sched.close(30)
    assert steps == 2  # both prompts' chunks (the grafted one's tail) in one step, both choice sets in the next
    assert sched.steps == steps  # the refused calls ran nothing
    for (best, scores, rep), (best2, scores2, rep2) in zip(alone, got):
        assert scores2 == scores and best2 == best
        assert (rep2.tokens_grafted, rep2.tokens_decoded, rep2.tokens_scored) == \
            (rep.tokens_grafted, rep.tokens_decoded, rep.tokens_scored)
    assert got[0][2].tokens_grafted == 32


def test_a_batch_refuses_choices_it_cannot_score(tmp_path, tiny_ggufs):
    eng = Engine.open(str(tiny_ggufs["llama"]), tmp_path / "store", chunk=16)
    from kvmemory.errors import InvalidInput

    batch = eng.batch()
    with pytest.raises(InvalidInput, match="max_new_tokens=0"):
        batch.add([5, 6, 7], choices=[[3]], max_new_tokens=2)
    with pytest.raises(InvalidInput, match="no choices"):
        batch.add([5, 6, 7], choices=[])
    with pytest.raises(InvalidInput, match="at least one token"):
        batch.add([5, 6, 7], choices=[[3], []])
    with pytest.raises(InvalidInput):
        batch.add([5, 6, 7], choices=[[eng.runner.vocab_size + 5]])
    assert not batch.sequences


def test_a_prompt_being_computed_is_grafted_by_the_same_prompt_not_computed_twice(tmp_path, tiny_ggufs):
    """Two clients send the same prompt at once, nothing stored: the second waits for the first's blocks
    (stored as each chunk is computed), grafts them, and gets the bits it gets computing alone."""
    eng = Engine.open(str(tiny_ggufs["llama"]), tmp_path / "store", chunk=16)
    rng = random.Random(3)
    ids = [rng.randrange(3, eng.runner.vocab_size) for _ in range(53)]  # 3 whole chunks and a tail
    other = [rng.randrange(3, eng.runner.vocab_size) for _ in range(20)]
    cold = Engine.open(str(tiny_ggufs["llama"]), tmp_path / "cold", chunk=16)
    ref = cold.forward(ids, max_new_tokens=4, stop_token_ids=(), keep_logits=True)[0]
    batch = eng.batch(64)
    first = batch.add(ids, max_new_tokens=4, stop_token_ids=(), keep_logits=True, store_new_blocks=True)
    between = batch.add(other, max_new_tokens=2, stop_token_ids=(), store_new_blocks=True)
    second = batch.add(ids, max_new_tokens=4, stop_token_ids=(), keep_logits=True, store_new_blocks=True)
    batch.step()
    assert first.prepared and between.prepared and not second.prepared  # it waits; the one behind does not
    batch.run()
    assert first.report.tokens_grafted == 0 and first.blocks_stored == 3
    assert second.report.tokens_grafted == 48 and second.report.tokens_computed == 5
    grafted = eng.forward(ids, max_new_tokens=4, stop_token_ids=(), keep_logits=True)  # the stored blocks
    assert grafted[1].tokens_grafted == 48
    assert first.result.logits_sha256 == ref.logits_sha256
    assert second.result.logits_sha256 == grafted[0].logits_sha256
    for s in (first, second):
        assert s.error is None
        assert s.result.generated == ref.generated
        assert torch.equal(s.result.all_logits()[-4:], ref.all_logits()[-4:])  # the last prompt row, decode rows
    # a graft the sequence must not take (graft=False) or a read-only store: no wait
    batch = eng.batch(64)
    fresh = [rng.randrange(3, eng.runner.vocab_size) for _ in range(40)]
    a = batch.add(fresh, store_new_blocks=True)
    b = batch.add(fresh, graft=False)
    batch.step()
    assert a.prepared and b.prepared
    batch.run()
