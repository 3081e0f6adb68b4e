"""The exact graft engine: a frozen model, its execution profile, the canonical runner and a store.

This is the layer the facade and the adapters stand on. Its public methods take token ids (or text)
and return the logits of a canonical forward, grafted or not, with a `GraftReport`, so anyone can
compare against a reference of their own:

    engine = Engine.open()                                # embedded SmolLM2, default store
    ids = engine.encode("some long shared context ...")
    engine.store_prefix(ids)                              # compute once, keep its blocks
    result, report = engine.forward(ids + more_ids, max_new_tokens=8)   # grafted
    reference = engine.recompute(ids + more_ids, max_new_tokens=8)      # from scratch
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvmemory.kernels import omp_pool
from kvmemory.store.blocks import BlockMeta, capture_payload, span_hashes
from kvmemory.errors import InvalidInput, ProfileMismatch
from kvmemory.engine.cache import Room
from kvmemory.engine.tier import VerifiedTier
from kvmemory.engine import pipeline
from kvmemory.engine.graft import GraftReport, LoadedChain, build_cache, check_chain, graft_spans, plan_chain
from kvmemory.models.devices import resolve_device, resolve_dtype
from kvmemory.models.loading import DEFAULT_MODEL, LoadedModel, files_model_sha256, load_model, model_identity
from kvmemory.models.gguf_model import release_freed_memory
from kvmemory.engine.determinism import Determinism
from kvmemory.engine.profile import ExecutionProfile, build_profile
from kvmemory.engine.runner import (DEFAULT_CHUNK, GREEDY, CanonicalRunner, ForwardResult, Sampling, check_cuts,
                                    chunk_spans, span_boundary)
from kvmemory.store.local import BlockRow
from kvmemory.engine.verify import Comparison, compare_runs, make_attestation


@dataclass(slots=True, frozen=True)
class VerifyReport:
    """A grafted run checked against a recompute from scratch (plus the single-pass diagnostic)."""

    graft_point: int
    tokens: int
    comparison: Comparison
    attestation: dict
    single_pass_max_abs_diff: float | None
    graft_report: GraftReport
    recompute_seconds: float
    graft_seconds: float

    @property
    def bit_identical(self) -> bool:
        return self.comparison.bit_identical

    def to_json(self) -> dict:
        return {
            "graft_point": self.graft_point,
            "tokens": self.tokens,
            **self.comparison.to_json(),
            "attestation_id": self.attestation["attestation_id"],
            "single_pass_max_abs_diff": self.single_pass_max_abs_diff,
            "recompute_seconds": round(self.recompute_seconds, 4),
            "graft_seconds": round(self.graft_seconds, 4),
            "graft": self.graft_report.to_json(),
        }


def graft_point_for(n_tokens: int, chunk: int, cuts: Sequence[int] = ()) -> int:
    """Where a graft of an n-token prompt ends at most: the last chunk boundary (a multiple of the grid,
    or a cut) before its last token."""
    spans = graft_spans(n_tokens, chunk, cuts)
    return spans[-1][1] if spans else 0


def _pinned(method):
    """An engine method that computes: it runs with the engine's torch settings applied (determinism.py)."""

    @functools.wraps(method)
    def pinned(self, *args, **kwargs):
        with self.determinism.applied():
            return method(self, *args, **kwargs)

    return pinned


class Engine:
    """A frozen model + profile + canonical runner + store."""

    def __init__(self, loaded: LoadedModel, store, *, chunk: int = DEFAULT_CHUNK, threads: int | None = None,
                 max_positions: int | None = None, model_sha256: str | None = None, kv_dtype=None,
                 step: str = "auto"):
        """An engine over a model already loaded. The profile's `model_sha256` is the SHA-256 of the
        weights in memory (profile.weights_sha256) unless `model_sha256` is given: `Engine.open` gives
        the model files' identity instead (profile.py says why that is sound), which a LoadedModel
        passed here does not get, since its weights may have been changed after load_model read them.
        `step`: "auto" = CUDA graphs of static steps on a GPU, the dynamic path on the CPU (static_step.py)."""
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.store = store
        self.device = next(self.model.parameters()).device
        # torch's process-wide settings (deterministic algorithms, threads, ...) are pinned only while
        # this engine computes and restored after each call (determinism.py): nothing leaks to the caller.
        self.determinism = Determinism.for_device(self.device, threads)
        # made under the pinned settings: a graph captured now (the probe) is replayed by later calls
        with self.determinism.applied():
            self.runner = CanonicalRunner(self.model, chunk, max_positions, kv_dtype, step=step)
        # K/V buffers kept between grafted forwards (cache.Room; room.clear() frees them); a static runner's
        # own cache plays that part, so a graft lands where its steps read
        self.room = self.runner.static or Room()
        # Verified block payloads kept for chains grafted again (tier.py: budget, trust, memory; tier.clear()).
        self.tier = VerifiedTier.for_device(self.device)
        self.chunk = chunk
        with self.determinism.applied():
            self.profile: ExecutionProfile = build_profile(self.model, self.tokenizer, chunk, self.determinism,
                                                         model_sha256=model_sha256, kv_dtype=self.runner.kv_dtype,
                                                         step_mode=self.runner.step_mode)
        self.profile_id = self.profile.profile_id
        if not getattr(store, "readonly", False):
            store.put_profile(self.profile_id, self.profile.to_dict())

    @classmethod
    def open(cls, model: str = DEFAULT_MODEL, store=None, *, chunk: int = DEFAULT_CHUNK, dtype=None,
             device: str = "auto", threads: int | None = None, attn_implementation: str = "sdpa",
             max_positions: int | None = None, linears: str = "auto", kv_dtype: str = "auto",
             profile: str = "default", step: str = "auto") -> "Engine":
        """Load `model` and open `store`. `device`: "auto" (a GPU where one and the CUDA graft kernel
        are usable, except for the embedded model, which stays on the CPU), "cpu", "cuda", "cuda:N";
        `dtype`: "auto" / None (the checkpoint's own on the CPU, bfloat16 on a GPU), "float32",
        "bfloat16", "float16" (models/devices.py: a device that is not here raises DeviceUnavailable
        before anything loads). `step`: "auto", "dynamic", "static", "cuda-graph" (static_step.py).
        `linears`: what computes the linear layers on the CPU
        (loading.LINEARS; each is its own profile): "auto" = from the embedded model's GGUF blocks
        where the kernel runs (gguf_linear.py), else oneDNN-packed (packed_linear.py); "q8" = the same
        blocks with 8-bit activations and integer dot products, as llama.cpp computes (faster; not
        gguf-py's float32 sums, so blocks of its own); "plain" keeps torch's (slower, no second copy of
        the weights in memory).
        `kv_dtype`: the dtype the cache keeps K/V in. "auto": bfloat16 under a float32 model on the
        CPU where kvmemory's attention runs and every layer attends fully (runner.resolve_kv_dtype:
        half the bytes per block to store, read and verify), else the model's; "float32" /
        "bfloat16" ask for one (each is its own profile: cache.py).
        `profile`: "default" (the options above), or "stock": transformers' own `sdpa` attention
        untouched, torch's linears, a float32 model with float32 K/V, on the same grid and pinned
        threads (loading.PROFILES). Its logits can be re-derived without kvmemory
        (examples/check_attestation.py); options that contradict it raise InvalidInput.
        `step`: how each forward step runs (a profile field, `step_mode`): "auto" captures static steps
        in CUDA graphs on a GPU ("cuda-graph"; "static", said in a warning, where capturing fails) and
        runs the dynamic path on the CPU; "dynamic", "static", "cuda-graph" ask for one
        (engine/static_step.py)."""
        from kvmemory.models.loading import PROFILES, stock_options
        from kvmemory.store.open import open_store

        if profile not in PROFILES:
            raise InvalidInput(f"profile must be one of {', '.join(PROFILES)}, not {profile!r}")
        device = resolve_device(device, model=model)  # before the store opens or the model loads
        dtype = resolve_dtype(dtype, device, profile=profile)
        if profile == "stock":
            dtype, linears = stock_options(dtype=dtype, linears=linears, attn_implementation=attn_implementation,
                                           kv_dtype=kv_dtype)
            kv_dtype = "float32"
        # A folder (local store), a redis:// URL (shared store), None (KVMEMORY_STORE or the default).
        store = open_store(store)
        loaded = load_model(model, dtype=dtype, device=device, attn_implementation=attn_implementation,
                            linears=linears, profile=profile)
        # The model was read from files by load_model just now, and nothing else has touched it: its files
        # identify its weights (loading.weights_files), so opening does not hash gigabytes of them.
        files = files_model_sha256(loaded.weights_files) if loaded.weights_files else None
        engine = cls(loaded, store, chunk=chunk, threads=threads, max_positions=max_positions, kv_dtype=kv_dtype,
                     model_sha256=files, step=step)
        # the profile's hashing of the tokenizer (a 33 MB JSON string for Gemma 3) and the load's other
        # transients, handed back: ~90 MB of resident memory glibc would otherwise keep (issue 46's bound)
        release_freed_memory()
        omp_pool.after_parallel_work()  # the load's OpenMP pool: the thread that computes makes its own
        return engine

    @functools.cached_property
    def model_identity(self) -> dict | None:
        """The files the model was read from, by SHA-256 (loading.model_identity), named in attestations;
        computed once per engine."""
        return model_identity(self.loaded.source, self.loaded.path)

    # ------------------------------------------------------------------ tokens
    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str) or not text.strip():
            raise InvalidInput("empty text: give something for the model to read")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def eos_token_ids(self) -> list[int]:
        ids = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            e = getattr(src, "eos_token_id", None)
            if isinstance(e, int):
                ids.add(e)
            elif isinstance(e, (list, tuple)):
                ids.update(int(x) for x in e)
        return sorted(ids)

    def stored_prefix_tokens(self, token_ids: Sequence[int], cuts: Sequence[int] = ()) -> int:
        """How many leading tokens of `token_ids` a grafted `forward` (with these `cuts`) would read from
        the store: the longest stored chain under this profile, never the last token."""
        rows = plan_chain(self.store, self.profile_id, [int(t) for t in token_ids], self.chunk, check_cuts(cuts))
        return sum(r.n_tokens for r in rows)

    # ------------------------------------------------------------------ profiles
    def require_profile(self, profile_id: str, what: str) -> None:
        """Raise ProfileMismatch naming every differing field when `profile_id` is not ours."""
        if profile_id == self.profile_id:
            return
        stored = self.store.get_profile(profile_id)
        if stored is None:
            raise ProfileMismatch(f"{what} were made under an unknown execution profile {profile_id[:12]}; "
                                  "recompute under the current profile")
        self.profile.require_same(ExecutionProfile.from_dict(stored), what)

    # ------------------------------------------------------------------ compute
    @_pinned
    def recompute(self, token_ids: Sequence[int], *, max_new_tokens: int = 0, sampling: Sampling = GREEDY,
                  stop_token_ids: Sequence[int] = (), keep_logits: bool = True, logits: str = "all",
                  cuts: Sequence[int] = ()) -> ForwardResult:
        """The reference: the canonical runner from scratch, no graft (`logits`, `cuts`: runner.forward's)."""
        return self.runner.forward(token_ids, max_new_tokens=max_new_tokens, sampling=sampling,
                                   stop_token_ids=stop_token_ids, keep_logits=keep_logits, logits=logits, cuts=cuts)

    def _capture(self, token_ids: Sequence[int], sink: list, upto: int | None = None,
                 cuts: Sequence[int] = ()) -> Callable:
        """An on_chunk callback that turns each prefill chunk that ends on the grid or at a cut (up to
        position `upto`) into a block (meta, payload): the chunks a later graft with these cuts looks for."""
        n = len(token_ids) if upto is None else min(upto, len(token_ids))
        spans = [sp for sp in chunk_spans(0, len(token_ids), self.chunk, cuts)
                 if sp[1] <= n and span_boundary(sp[1], self.chunk, cuts)]
        hashes = span_hashes(self.profile_id, token_ids, spans)
        index = {sp: i for i, sp in enumerate(spans)}

        def on_chunk(s: int, e: int, cache) -> None:
            i = index.get((s, e))
            if i is None:
                return
            payload, dtype, ks, vs = capture_payload(cache, s, e)
            meta = BlockMeta(
                hash=hashes[i], parent=hashes[i - 1] if i else None, profile_id=self.profile_id, index=i,
                position=s, token_ids=tuple(int(t) for t in token_ids[s:e]), dtype=dtype,
                k_shapes=tuple(ks), v_shapes=tuple(vs), payload_nbytes=payload.numel(),
                payload_sha256=hashlib.sha256(memoryview(payload.numpy())).hexdigest(),
            )
            sink.append((meta, payload))

        return on_chunk

    @_pinned
    def compute_blocks(self, token_ids: Sequence[int], *, max_new_tokens: int = 0, keep_logits: bool = True,
                       sampling: Sampling = GREEDY, logits: str = "all", cuts: Sequence[int] = (),
                       upto: int | None = None) -> tuple[ForwardResult, list[tuple[BlockMeta, torch.Tensor]]]:
        """Recompute from scratch and capture every block of the prompt that ends on the grid or at one
        of the `cuts`, up to position `upto` (`logits`: runner.forward's; the blocks hold K/V, the same in
        either mode)."""
        cuts = check_cuts(cuts)
        blocks: list = []
        result = self.runner.forward(token_ids, max_new_tokens=max_new_tokens, keep_logits=keep_logits,
                                     sampling=sampling, on_chunk=self._capture(token_ids, blocks, upto, cuts),
                                     logits=logits, cuts=cuts)
        return result, blocks

    def store_prefix(self, token_ids: Sequence[int], *, pinned: bool = True, cuts: Sequence[int] = ()) -> int:
        """Compute a prefix once (from scratch) and keep its full blocks and those ending at `cuts` (pinned by
        default: a system prompt or few-shot block the user wants kept). Returns how many blocks it holds."""
        # K/V only: no logits needed
        _, blocks = self.compute_blocks(token_ids, keep_logits=False, logits="last", cuts=cuts)
        self.store.put_blocks(blocks, pinned=pinned)
        return len(blocks)

    def graft_chain(self, token_ids: Sequence[int], chain: LoadedChain, report: GraftReport, start: int = 0,
                    capacity: int = 0, cuts: Sequence[int] = ()):
        """Place a verified chain in a fresh cache (with room for `capacity` positions), refusing any
        block off its own position (the chunks of these `cuts`) or profile."""
        for m in chain.metas:
            self.require_profile(m.profile_id, "these blocks")
        end = check_chain(chain.metas, token_ids, self.chunk, start, cuts)
        return build_cache(self.runner, chain, report, capacity), end

    # A scheduler (engine/scheduler.py's BatchScheduler) that `forward` hands its sequence to, so that
    # it shares steps with other requests' (the same bits: engine/batch.py); None: every forward alone.
    batcher = None

    def forward(self, token_ids: Sequence[int], **kwargs) -> tuple[ForwardResult, GraftReport]:
        """`_forward`'s (below), in shared steps with other callers' forwards where a batcher is set and
        takes this call (the same result: engine/batch.py)."""
        b = self.batcher
        if b is None:
            return self._forward(token_ids, **kwargs)
        if b.takes():
            return b.forward(token_ids, **kwargs)
        with b.outside():  # a forward outside the batch: callers who come meanwhile join the batch (when_busy)
            return self._forward(token_ids, **kwargs)

    @_pinned
    def _forward(self, token_ids: Sequence[int], *, graft: bool = True, max_new_tokens: int = 0,
                sampling: Sampling = GREEDY, stop_token_ids: Sequence[int] | None = None,
                keep_logits: bool = False, store_new_blocks: bool = False, entries_used: Sequence[str] = (),
                on_token: Callable[[int], bool] | None = None,
                rows: Sequence[BlockRow] | None = None, logits: str = "all",
                cuts: Sequence[int] = (), keep_cache: bool = False) -> tuple[ForwardResult, GraftReport]:
        """Canonical forward with the longest stored chain grafted; logits equal to `recompute`'s with the
        same `cuts` (in the same `logits` mode: "all" rows, or "last", the rows a token is chosen from;
        runner.forward). `cuts`: where the prompt's segments end (a stored entry, a chat turn): the graft
        may end there on a tail block, and the blocks stored end there too (runner.chunk_spans).
        `rows` grafts these blocks (written, not yet catalogued) instead of the catalogue's chain.
        `keep_cache`: the cache is handed over in `result.extra["cache"]` (`choose` scores from it)."""
        token_ids = [int(t) for t in token_ids]
        self.runner.check_ids(token_ids, max_new_tokens)
        cuts = check_cuts(cuts)
        n = len(token_ids)
        cache, start, report = self._graft_longest(token_ids, graft, entries_used, rows, new_tokens=max_new_tokens,
                                                   cuts=cuts)
        new_blocks: list = []
        result = self.runner.forward(
            token_ids, start=start, cache=cache, max_new_tokens=max_new_tokens, sampling=sampling,
            stop_token_ids=self.eos_token_ids if stop_token_ids is None else stop_token_ids,
            keep_logits=keep_logits, on_token=on_token,
            on_chunk=self._capture(token_ids, new_blocks, cuts=cuts) if store_new_blocks else None, logits=logits,
            cuts=cuts,
        )
        report.tokens_grafted = start
        report.tokens_computed = n - start
        report.tokens_decoded = len(result.generated)
        report.compute_seconds = result.prefill_seconds
        report.decode_seconds = result.decode_seconds
        if new_blocks and not getattr(self.store, "readonly", False):
            self.store.put_blocks(new_blocks)
            report.blocks_stored = len(new_blocks)
        if not keep_cache:
            self.room.give(result.extra.pop("cache", None))  # nobody else holds it: the next graft reads into it
        return result, report

    def _graft_longest(self, token_ids: list[int], graft: bool, entries_used: Sequence[str],
                       rows: Sequence[BlockRow] | None = None, new_tokens: int = 0, cuts: tuple[int, ...] = ()):
        """A cache holding the longest verified stored chain of `token_ids` (with room for the prompt
        and `new_tokens` more), its end, and the report."""
        report = GraftReport(tokens_total=len(token_ids), entries_used=list(entries_used))
        if not graft:
            rows = []
        elif rows is None:
            rows = plan_chain(self.store, self.profile_id, token_ids, self.chunk, cuts)
        else:  # the last prompt token is always computed: never graft past the graft point
            limit, total, kept = graft_point_for(len(token_ids), self.chunk, cuts), 0, []
            for r in rows:
                if total + r.n_tokens > limit:
                    break
                kept.append(r)
                total += r.n_tokens
            rows = kept
        capacity = len(token_ids) + new_tokens
        chain = pipeline.load_chain(self.store, rows, report, runner=self.runner, capacity=capacity,
                                    room=self.room, tier=self.tier)
        cache, start = self.graft_chain(token_ids, chain, report, capacity=capacity, cuts=cuts)
        return cache, start, report

    def batch(self, token_budget: int | None = None):
        """A `Batch` of sequences stepping together over this engine (batch.py): `add` takes
        `forward`'s arguments, `step` / `run` compute, each sequence's result equals `forward`'s."""
        from kvmemory.engine.batch import DEFAULT_TOKEN_BUDGET, Batch

        return Batch(self, DEFAULT_TOKEN_BUDGET if token_budget is None else token_budget)

    def forward_many(self, requests: Sequence[dict], token_budget: int | None = None):
        """`forward` for several requests (each a dict of `forward`'s arguments, `token_ids` included)
        computed in shared steps; returns [(ForwardResult, GraftReport)] in order (a request that failed
        raises its error)."""
        batch = self.batch(token_budget)
        seqs = [batch.add(**r) for r in requests]
        batch.run()
        for s in seqs:
            if s.error is not None:
                raise s.error
        return [(s.result, s.report) for s in seqs]

    def choose(self, token_ids: Sequence[int], choices: Sequence[Sequence[int]], *, graft: bool = True,
               entries_used: Sequence[str] = (), cuts: Sequence[int] = ()) -> tuple[int, list[float], GraftReport]:
        """Which choice (token ids) the model finds likeliest after `token_ids`: the prompt is grafted
        and prefilled (logits="last": runner.forward), then every choice is scored (runner.score_choices);
        where a batcher takes the call, both run in steps shared with other callers' rows (batch.py: the
        same bits).
        Returns the best index, every choice's log-likelihood and the report (`tokens_decoded` = the
        chosen choice's tokens, `tokens_scored` = all the choices' tokens)."""
        return self.choose_many([dict(token_ids=token_ids, choices=choices, graft=graft, entries_used=entries_used,
                                      cuts=cuts)])[0]

    def choose_many(self, requests: Sequence[dict]) -> list[tuple[int, list[float], GraftReport]]:
        """`choose` for several requests (each a dict of its arguments), in the same steps where a
        batcher takes them (a chat's answer and its contrast, `memory/answers.py`); else one by one."""
        reqs = []
        for r in requests:
            token_ids, choices = [int(t) for t in r["token_ids"]], self.runner.check_choices(r["choices"])
            self.runner.check_ids(token_ids, max(len(c) for c in choices))
            # logits="last": the prompt's last row is all a choice's score reads (no lm_head over the others)
            reqs.append(dict(r, token_ids=token_ids, choices=choices, logits="last"))
        b = self.batcher
        if b is not None and b.batch.scores_choices and b.takes():
            done = b.forward_many(reqs)
            return [self._chosen(r["choices"], result.extra["choice_scores"], report, result.decode_seconds)
                    for r, (result, report) in zip(reqs, done)]
        # Alone, one after another: a lone prompt chunk takes the C layer step (llama_step), which a
        # shared step of two prompts' chunks does not (measured: 340 against 420 ms for a recurrence's two)
        out = []
        for r in reqs:
            choices = r.pop("choices")
            # a static step mode keeps one cache for one sequence: its prefill runs alone, never in the batch
            fwd = self._forward if self.runner.static is not None else self.forward
            result, report = fwd(keep_cache=True, **r)
            out.append(self._scored(r["token_ids"], result, report, choices))
        return out

    @staticmethod
    def _chosen(choices: Sequence[Sequence[int]], scores: list[float], report: GraftReport,
                seconds: float) -> tuple[int, list[float], GraftReport]:
        best = max(range(len(choices)), key=lambda i: (scores[i], -i))  # ties: the first listed
        report.tokens_decoded = len(choices[best])
        report.tokens_scored = sum(len(c) for c in choices)
        report.decode_seconds = seconds
        return best, scores, report

    @_pinned
    def _scored(self, token_ids: list[int], result: ForwardResult, report: GraftReport,
                choices: Sequence[Sequence[int]]) -> tuple[int, list[float], GraftReport]:
        """`choose`'s scoring, over the prompt's cache its forward handed over."""
        t0 = time.perf_counter()
        scores = self.runner.score_choices(len(token_ids), result.extra.pop("cache"), result.extra["next_logits"],
                                           choices)
        return self._chosen(choices, scores, report, time.perf_counter() - t0)

    # ------------------------------------------------------------------ proof
    @_pinned
    def verify_tokens(self, token_ids: Sequence[int], *, decode_tokens: int = 4, single_pass: bool = True,
                      reference: ForwardResult | None = None, rows: Sequence[BlockRow] | None = None,
                      cuts: Sequence[int] = ()) -> VerifyReport:
        """Graft what the store holds for `token_ids`, recompute from scratch (with the same `cuts`),
        compare every logit after the graft point (prefill and decode). `reference` may pass an already
        computed recompute (with these cuts); `rows` grafts just-written blocks instead of the
        catalogue's chain (proof before commit)."""
        cuts = check_cuts(cuts)
        t0 = time.perf_counter()
        ref = reference or self.recompute(token_ids, max_new_tokens=decode_tokens, stop_token_ids=(), cuts=cuts)
        t1 = time.perf_counter()
        got, report = self.forward(token_ids, max_new_tokens=decode_tokens, stop_token_ids=(), keep_logits=True,
                                   rows=rows, cuts=cuts)
        t2 = time.perf_counter()
        comparison = compare_runs(ref, got)
        diag = None
        if single_pass:
            with torch.inference_mode():
                ids = torch.tensor([list(token_ids)], device=self.device)
                sp = self.model(input_ids=ids).logits[0, got.start:].float().cpu()
            diag = float((sp - ref.prefill_logits[got.start:].float()).abs().max()) if sp.numel() else 0.0
        attestation = make_attestation(token_ids, self.profile, got.start, ref, comparison,
                                       model=self.model_identity, cuts=cuts)
        return VerifyReport(got.start, len(token_ids), comparison, attestation, diag, report,
                            t1 - t0 if reference is None else ref.prefill_seconds + ref.decode_seconds, t2 - t1)

    def rows_for(self, blocks: Sequence[tuple[BlockMeta, torch.Tensor]]) -> list[BlockRow]:
        """Catalogue-like rows for blocks whose files are written but not yet catalogued."""
        from kvmemory.store.blocks import encode_header

        return [BlockRow(m.hash, m.parent, m.profile_id, m.index, m.n_tokens, m.payload_sha256,
                         m.payload_nbytes, len(encode_header(m)) + m.payload_nbytes, False, False, False)
                for m, _ in blocks]


__all__ = ["Engine", "VerifyReport", "graft_point_for"]
