"""Several sequences advancing together: which rows share each step, under a per-step token budget.

`Batch` holds sequences (a prompt, grafted or not, then decoding) and plans every step as serving
engines do (vLLM's and SGLang's per-step token budget): first one decode row per generating sequence,
then the next grid chunk (runner.chunk_spans) of sequences still reading their prompt, in the order
they joined, while the step's tokens stay within `token_budget` (a step always takes at least one
item, so a chunk longer than the budget still runs). A sequence joins at the next step (`add`) and
leaves when it is done or cancelled (`cancel`), freeing its cache at once. A sequence's new blocks are
stored as each chunk is computed; one that would graft blocks an earlier sequence is still computing
(the same prompt from several clients at once) joins once they are stored, and grafts them
(`_waits_for_blocks`), so a prompt no one has stored yet is computed once, not once per client.

Each sequence follows runner.forward's steps exactly: the same chunks at the same positions over its
own cache (the longest stored chain grafted first, as `Engine.forward` grafts it), then one decode row
per step with the token chosen as `runner.forward` chooses it; batched_step.py makes each row's logits
the bits of that sequence's step run alone, so its `ForwardResult` (logits, their hash, argmax, tokens)
equals `Engine.forward`'s for the same arguments: batching changes throughput, never an answer.

Where the runner's steps cannot share rows (batched_step.why_not) the sequences still interleave, each
item computed alone; in the static step modes, whose one cache holds one sequence, one sequence runs at
a time (first come, first served).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvmemory.engine.batched_step import BatchedStep, StepItem
from kvmemory.engine.graft import GraftReport, graft_spans
from kvmemory.engine.profile import tensor_bytes
from kvmemory.engine.runner import (GREEDY, ForwardResult, Sampling, _choose, add_choice_logits, check_cuts,
                                    choice_runs, chunk_spans, multi_token, span_boundary)
from kvmemory.errors import InvalidInput

DEFAULT_TOKEN_BUDGET = 256  # tokens per step: 16 decode rows and three 64-token chunks


@dataclass(eq=False)
class BatchSequence:
    """One sequence of a batch: its request, its cache, and what it has produced so far."""

    token_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    stops: set[int]
    keep_logits: bool
    logits: str
    cuts: tuple[int, ...]
    graft: bool
    entries_used: tuple[str, ...]
    on_token: Callable[[int], bool] | None
    rows: object = None  # BlockRow list to graft instead of the catalogue's chain (Engine.forward's `rows`)
    store_new_blocks: bool = False
    keep_cache: bool = False  # hand the cache over in result.extra["cache"] (Engine.choose scores from it)
    choices: tuple | None = None  # token ids of answers to score after the prompt (Engine.choose), in a step
    blocks_stored: int = 0
    # state
    start: int = 0
    cache: object = None
    report: GraftReport | None = None
    spans: list[tuple[int, int]] = field(default_factory=list)
    next_span: int = 0
    pending: int | None = None  # the token the next decode row feeds
    generated: list[int] = field(default_factory=list)
    result: ForwardResult | None = None
    cancelled: bool = False
    error: BaseException | None = None
    _hasher: object = None
    _argmax: list[int] = field(default_factory=list)
    _prefill: list[torch.Tensor] = field(default_factory=list)
    _decode: list[torch.Tensor] = field(default_factory=list)
    _gen: torch.Generator | None = None
    _last: torch.Tensor | None = None
    _t: list[float] = field(default_factory=list)  # started, prefill done
    _stopped_by: str = "length"
    _on_chunk: Callable | None = None
    _new_blocks: list = field(default_factory=list)
    _scores: list[float] | None = None  # the choices' scores so far (their first tokens')
    _choice_items: list | None = None  # the choices' step items while they wait for a step

    @property
    def scoring(self) -> bool:
        return self._choice_items is not None

    @property
    def kv_need(self) -> int:
        """K/V positions it holds while it runs: its prompt and tokens to decode, and a copy of the prompt
        per run of its choices' tokens (runner.choice_runs) while those are scored."""
        n = len(self.token_ids) + self.max_new_tokens
        if self.choices:
            n += sum(len(self.token_ids) + len(r) for r in choice_runs(self.choices))
        return n

    @property
    def done(self) -> bool:
        return self.result is not None or self.cancelled or self.error is not None

    @property
    def prepared(self) -> bool:
        return self.report is not None

    @property
    def decoding(self) -> bool:
        return self.pending is not None

    def _account(self, logits: torch.Tensor, prefill: bool) -> None:
        self._hasher.update(tensor_bytes(logits))
        self._argmax.extend(logits.argmax(-1).tolist())
        if self.keep_logits:
            (self._prefill if prefill else self._decode).append(logits.detach().cpu())


class Batch:
    """Sequences of one engine stepping together (see the module docstring). Not thread-safe: one
    thread calls `add`, `step` and `cancel` (a server's scheduler)."""

    def __init__(self, engine, token_budget: int = DEFAULT_TOKEN_BUDGET, kv_tokens: int | None = None):
        """`kv_tokens`: the K/V positions (prompt + tokens to decode, each) the running sequences may
        hold together; a sequence that would pass it waits until one leaves (None: no limit; one
        sequence always runs)."""
        if not isinstance(token_budget, int) or isinstance(token_budget, bool) or token_budget < 1:
            raise InvalidInput(f"token_budget must be a positive number of tokens, got {token_budget!r}")
        self.engine = engine
        self.runner = engine.runner
        self.stepper = BatchedStep(self.runner)
        self.token_budget = token_budget
        self.kv_tokens = kv_tokens
        self.sequences: list[BatchSequence] = []  # waiting and running, in the order they joined
        self.steps = 0
        self.last_rows = 0  # items in the last step
        self.last_tokens = 0

    @property
    def one_at_a_time(self) -> bool:
        """The static step modes: one cache, one sequence at a time."""
        return self.runner.static is not None

    def add(self, token_ids: Sequence[int], *, graft: bool = True, max_new_tokens: int = 0,
            sampling: Sampling = GREEDY, stop_token_ids: Sequence[int] | None = None, keep_logits: bool = False,
            entries_used: Sequence[str] = (), on_token: Callable[[int], bool] | None = None, logits: str = "all",
            cuts: Sequence[int] = (), rows=None, store_new_blocks: bool = False,
            keep_cache: bool = False, choices: Sequence[Sequence[int]] | None = None) -> BatchSequence:
        """A sequence that joins at the next step; the arguments are `Engine.forward`'s, and `choices`:
        token ids of answers scored after the prompt as `Engine.choose` scores them (runner.score_choices),
        their log-likelihoods in `result.extra["choice_scores"]` (the choices' tokens computed in a step
        of their own, shared with the other sequences' rows, where the step is shared)."""
        if logits not in ("all", "last"):
            raise InvalidInput(f"logits must be 'all' or 'last', got {logits!r}")
        if logits == "last" and keep_logits:
            raise InvalidInput("logits='last' computes no prefill rows to keep: pass keep_logits=False")
        token_ids = [int(t) for t in token_ids]
        self.runner.check_ids(token_ids, max_new_tokens)
        stops = self.engine.eos_token_ids if stop_token_ids is None else stop_token_ids
        if choices is not None:
            choices = self.runner.check_choices(choices)
            if max_new_tokens:
                raise InvalidInput("choices are scored after the prompt: pass max_new_tokens=0 with them")
        seq = BatchSequence(token_ids, int(max_new_tokens), sampling, {int(t) for t in stops}, keep_logits, logits,
                            check_cuts(cuts), graft, tuple(entries_used), on_token, rows, bool(store_new_blocks),
                            keep_cache=bool(keep_cache) and self.runner.static is None, choices=choices)
        self.sequences.append(seq)
        return seq

    @property
    def scores_choices(self) -> bool:
        """Whether a sequence's choices (`add(choices=)`) share steps with other rows here."""
        return self.stepper.shared and self.runner.static is None and self.runner._lean_step is not None

    def cancel(self, seq: BatchSequence) -> None:
        """Stop `seq` now: it leaves the batch and its cache is freed."""
        seq.cancelled = True
        self._leave(seq)

    def _leave(self, seq: BatchSequence) -> None:
        seq.cache = None
        seq._choice_items = None
        if seq in self.sequences:
            self.sequences.remove(seq)

    @property
    def active(self) -> list[BatchSequence]:
        return [s for s in self.sequences if not s.done]

    def _prepare(self, seq: BatchSequence) -> None:
        """Graft the longest stored chain into a cache of the sequence's own (Engine.forward's graft)."""
        eng = self.engine
        n = len(seq.token_ids)
        cache, start, report = eng._graft_longest(seq.token_ids, seq.graft, seq.entries_used, seq.rows,
                                                  new_tokens=seq.max_new_tokens, cuts=seq.cuts)
        if not span_boundary(start, self.runner.chunk, seq.cuts) or not 0 <= start < n:
            raise InvalidInput(f"prefill must start on the grid or at a cut inside the prompt (start={start})")
        if self.runner.static is not None:
            cache = self.runner.static.begin(cache, start, n, n + seq.max_new_tokens)
        seq.cache, seq.start, seq.report = cache, start, report
        seq.spans = chunk_spans(start, n, self.runner.chunk, seq.cuts)
        seq._hasher = hashlib.sha256()
        seq._gen = torch.Generator(device="cpu").manual_seed(seq.sampling.seed)
        seq._t = [time.perf_counter()]
        if seq.store_new_blocks:
            seq._on_chunk = eng._capture(seq.token_ids, seq._new_blocks, cuts=seq.cuts)

    def plan(self) -> list[tuple[BatchSequence, int, int]]:
        """The next step's items: (sequence, start, end) of the positions each computes: every decoding
        sequence's row first, then the choices of sequences scoring them (start = end = the prompt's end:
        their items are `_choice_items`), then prompt chunks in joining order within the token budget."""
        running = self.active
        if self.one_at_a_time:
            running = running[:1]
        items, tokens = [], 0
        for s in running:
            if s.decoding:
                p = len(s.token_ids) + len(s.generated) - 1
                items.append((s, p, p + 1))
                tokens += 1
        for s in running:
            if s.scoring:
                cost = sum(it.ids.shape[1] for it in s._choice_items)
                if items and tokens + cost > self.token_budget:
                    break
                n = len(s.token_ids)
                items.append((s, n, n))
                tokens += cost
        for s in running:
            if s.decoding or s.scoring:
                continue
            if not s.prepared:
                if self.kv_tokens is not None and self._held() and self._held() + s.kv_need > self.kv_tokens:
                    break  # first come, first served: it waits for K/V room, and so do those behind it
                if self._waits_for_blocks(s):
                    continue  # an earlier sequence is computing blocks it will graft: not computed twice
                # a sequence not yet grafted: its first chunk starts where its graft ends (known once grafted)
                if items and tokens + 1 > self.token_budget:
                    break
                try:
                    self._prepare(s)
                except Exception as exc:  # noqa: BLE001 - this sequence fails (its error kept), the others go on
                    s.error = exc
                    self._leave(s)
                    continue
            a, b = s.spans[s.next_span]
            if items and tokens + (b - a) > self.token_budget:
                break
            items.append((s, a, b))
            tokens += b - a
        return items

    def _waits_for_blocks(self, s: BatchSequence) -> bool:
        """Whether an earlier sequence still reading its prompt will store blocks that `s` would graft
        (the same tokens over the same spans from position 0: the same chain hashes, graft.plan_chain):
        `s` then joins once they are stored and grafts them instead of computing them again (requests
        that share a prompt not stored yet: the same question from several clients at once). The graft
        gives the bits its computation would (the exactness contract), so this changes time, not bits."""
        if not s.graft or s.rows is not None or getattr(self.engine.store, "readonly", False):
            return False
        chunk = self.runner.chunk
        mine = graft_spans(len(s.token_ids), chunk, s.cuts)
        for t in self.sequences:
            if t is s:
                return False
            if (t.done or not t.prepared or not t.store_new_blocks or t.decoding or t.scoring
                    or t.next_span >= len(t.spans)):
                continue
            at = t.spans[t.next_span][0]  # t has computed (and stored) its blocks up to here
            if s.token_ids[:at + 1] != t.token_ids[:at + 1]:
                continue  # they part before t's next span: nothing t computes from here is s's
            end = 0  # where the spans both prompts hold alike end (slices compared: no loop over tokens)
            for x, y in zip(mine, chunk_spans(0, len(t.token_ids), chunk, t.cuts)):
                if x != y or not span_boundary(x[1], chunk, t.cuts) or s.token_ids[x[0]:x[1]] != t.token_ids[x[0]:x[1]]:
                    break
                end = x[1]
            if end > at:
                return True
        return False

    def _store_blocks(self, s: BatchSequence) -> None:
        """Store the blocks `s` has captured so far, at once (a sequence waiting for them grafts them at
        the next step: `_waits_for_blocks`)."""
        if s._new_blocks and not getattr(self.engine.store, "readonly", False):
            self.engine.store.put_blocks(list(s._new_blocks))
            s.blocks_stored += len(s._new_blocks)
            s.report.blocks_stored = s.blocks_stored
        s._new_blocks.clear()  # in place: the capture callback appends to this very list

    def _held(self) -> int:
        """K/V positions the prepared sequences hold (reserved for their prompt and tokens to decode)."""
        return sum(s.kv_need for s in self.sequences if s.prepared and not s.done)

    @torch.inference_mode()
    def step(self) -> int:
        """Run one step (under the engine's pinned settings); returns how many sequences it advanced
        (0: nothing left to do)."""
        with self.engine.determinism.applied():
            planned = self.plan()
            if not planned:
                return 0
            device = self.runner.device
            step_items, at = [], []  # at: where each planned item's logits are in the step's outputs
            for s, a, b in planned:
                if s.scoring:  # its choices, each a row of its own
                    at.append(slice(len(step_items), len(step_items) + len(s._choice_items)))
                    step_items.extend(s._choice_items)
                    continue
                at.append(len(step_items))
                if s.decoding:
                    ids = torch.tensor([[s.pending]], device=device)
                    rows = None
                else:
                    ids = torch.tensor([s.token_ids[a:b]], dtype=torch.long, device=device)
                    rows = None if s.logits == "all" else int(b == len(s.token_ids))
                step_items.append(StepItem(ids, a, s.cache, rows))
            flat = self.stepper.step(step_items)
            outs = [flat[i] for i in at]
            self.steps += 1
            self.last_rows, self.last_tokens = len(step_items), sum(int(it.ids.shape[1]) for it in step_items)
            for (s, a, b), logits in zip(planned, outs):
                if s.scoring:
                    add_choice_logits(s._scores, s.choices, logits)
                    s._choice_items = None
                    self.runner.choices_done(len(s.token_ids), s.cache)
                    self._finish(s)
                elif s.decoding:
                    s._account(logits, prefill=False)
                    s._last = logits
                    self._choose(s)
                else:
                    s._account(logits, prefill=True)
                    s._last = logits
                    s.next_span += 1
                    if s._on_chunk is not None:
                        s._on_chunk(a, b, s.cache)
                        self._store_blocks(s)
                    if s.next_span == len(s.spans):
                        s._t.append(time.perf_counter())
                        if s.choices is not None:
                            self._score_choices(s)
                        else:
                            self._choose(s)
            for s, _, _ in planned:
                if s.done:
                    self._leave(s)
            return len(planned)

    def _score_choices(self, s: BatchSequence) -> None:
        """After the last prompt chunk of a sequence with choices: their first tokens' scores now, and
        their other tokens in the next step (`_choice_items`), or now, as `runner.score_choices` computes
        them, where the step is not shared; then it finishes."""
        runner, n = self.runner, len(s.token_ids)
        try:
            s._scores = runner.first_choice_scores(s._last[-1], s.choices)
            if not multi_token(s.choices):
                self._finish(s)
            elif self.scores_choices and runner.choices_in_steps(s.cache):
                s._choice_items = runner.choice_items(n, s.cache, s.choices)
            else:
                s._scores = runner.score_choices(n, s.cache, s._last[-1], s.choices)
                s.cache = None  # consumed
                self._finish(s)
        except Exception as exc:  # noqa: BLE001 - kept on the sequence, raised to its caller
            s.error = exc
            s._choice_items = None

    def _choose(self, s: BatchSequence) -> None:
        """After a sequence's last prompt chunk or a decode step: pick its next token as runner.forward
        does, and finish it or leave the token for its next decode row. An error of its own (its
        `on_token` raising: a stream whose client went away) ends it alone."""
        try:
            self._choose_or_finish(s)
        except Exception as exc:  # noqa: BLE001 - kept on the sequence, raised to its caller
            s.error = exc
            s.pending = None

    def _choose_or_finish(self, s: BatchSequence) -> None:
        i = len(s.generated)
        s.pending = None
        if i >= s.max_new_tokens:
            self._finish(s)
            return
        tok = _choose(s._last[-1], s.sampling, s._gen)
        s.generated.append(tok)
        if tok in s.stops:
            s._stopped_by = "stop_token"
        elif s.on_token is not None and s.on_token(tok):
            s._stopped_by = "stop"
        elif i == s.max_new_tokens - 1:
            pass
        else:
            s.pending = tok
            return
        self._finish(s)

    def _finish(self, s: BatchSequence) -> None:
        t2 = time.perf_counter()
        t0, t1 = s._t[0], s._t[1] if len(s._t) > 1 else t2
        V = self.runner.vocab_size
        n = len(s.token_ids)
        cache = s.cache
        if self.runner.static is not None:
            cache = self.runner.static.view(n + max(len(s.generated) - 1, 0))
        s.result = ForwardResult(
            token_ids=list(s.token_ids), start=s.start, generated=list(s.generated),
            prefill_logits=torch.cat(s._prefill, 0) if s.keep_logits else None,
            decode_logits=(torch.cat(s._decode, 0) if s._decode else torch.empty(0, V)) if s.keep_logits else None,
            logits_sha256=s._hasher.hexdigest(), argmax=list(s._argmax), prefill_seconds=t1 - t0,
            decode_seconds=t2 - t1, stopped_by=s._stopped_by, extra={"next_logits": s._last[-1]})
        if s.choices is not None:
            s.result.extra["choice_scores"] = s._scores
        r = s.report
        r.tokens_grafted = s.start
        r.tokens_computed = n - s.start
        r.tokens_decoded = len(s.generated)
        r.compute_seconds = t1 - t0
        r.decode_seconds = t2 - t1
        self._store_blocks(s)
        if s.keep_cache and s.choices is None:
            s.result.extra["cache"] = cache  # the caller's now (Engine.choose): not given back to the room
        elif cache is not None:
            self.engine.room.give(cache)
        s._prefill, s._decode = [], []

    def run(self) -> None:
        """Step until every sequence is done."""
        while self.step():
            pass


__all__ = ["Batch", "BatchSequence", "DEFAULT_TOKEN_BUDGET"]
