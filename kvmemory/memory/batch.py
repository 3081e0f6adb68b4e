"""Remembering a file of JSON lines (`kvmemory remember --jsonl`), with the fate of every line.

A batch is read and checked whole before the model loads (`read_jsonl`): a line that is not a JSON
object, names a field `remember` does not take, or carries text `remember` would refuse is refused
there, with its line number. `remember_lines` then remembers the lines that passed in one batch
(`KVMemory.remember_many`: embeddings in one call, the KV computed back to back, one commit); a line
the verifier or the store refuses (StoreUnavailable when Redis went away, StoreFull, ...) is refused on
its own and the rest go on. `BatchReport` says what happened to each line, so a script can
retry exactly the refused ones; its exit status is 0 only when every line was remembered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmemory.errors import InvalidInput, KVMemoryError
from kvmemory.memory.inputs import check_namespace, check_text

# What a line may hold (the keyword arguments of `KVMemory.remember` it maps onto).
LINE_FIELDS = ("problem", "solution", "answer", "namespace", "verifier", "meta")

# The CLI's exit statuses (README "Command line"): every item done; an error before any item could be
# done (usage, a missing file or store, a model that does not load); some items refused (the rest done).
EXIT_OK = 0
EXIT_ERROR = 2
EXIT_PARTIAL = 3


@dataclass(slots=True)
class LineFate:
    """One line: remembered (with the entry's id) or refused (with the error's type and message)."""

    line: int
    item: dict | None = None  # the parsed line (None when it was not a JSON object)
    status: str = "pending"  # "remembered" | "refused"
    result: dict | None = None  # what `remember` reported for it
    error: str | None = None
    message: str | None = None

    def refuse(self, exc: KVMemoryError) -> None:
        self.status, self.error, self.message = "refused", type(exc).__name__, str(exc)

    def to_json(self) -> dict:
        out: dict[str, Any] = {"line": self.line, "status": self.status}
        if self.status == "remembered" and self.result is not None:
            out.update(id=self.result["id"], namespace=self.result["namespace"])
        if self.status == "refused":
            out.update(error=self.error, message=self.message)
        return out


@dataclass(slots=True)
class BatchReport:
    lines: list[LineFate] = field(default_factory=list)

    @property
    def remembered(self) -> list[LineFate]:
        return [f for f in self.lines if f.status == "remembered"]

    @property
    def refused(self) -> list[LineFate]:
        return [f for f in self.lines if f.status == "refused"]

    @property
    def pending(self) -> list[LineFate]:
        return [f for f in self.lines if f.status == "pending"]

    @property
    def exit_code(self) -> int:
        return EXIT_PARTIAL if self.refused else EXIT_OK

    def to_json(self) -> dict:
        return {"remembered": [f.result for f in self.remembered],
                "refused": [{"line": f.line, "error": f.error, "message": f.message} for f in self.refused],
                "lines": [f.to_json() for f in self.lines],
                "counts": {"lines": len(self.lines), "remembered": len(self.remembered),
                           "refused": len(self.refused)}}


def check_item(d: dict) -> None:
    """What `remember` would refuse in a line before any model runs (InvalidInput naming it)."""
    unknown = sorted(set(d) - set(LINE_FIELDS))
    if unknown:
        raise InvalidInput(f"unknown field(s) {', '.join(map(repr, unknown))}; a line takes {', '.join(LINE_FIELDS)}")
    check_text("problem", d.get("problem"))
    check_text("solution", d.get("solution"))
    if d.get("answer") is not None:
        check_text("answer", str(d["answer"]), required=False)
    if d.get("namespace") is not None:
        check_namespace(d["namespace"])
    if d.get("verifier") is not None and not isinstance(d["verifier"], str):
        raise InvalidInput(f"verifier must be a name (exact-answer, arithmetic, none), got {d['verifier']!r}")
    if d.get("meta") is not None and not isinstance(d["meta"], dict):
        raise InvalidInput(f"meta must be a JSON object, got {type(d['meta']).__name__}")


def read_jsonl(path: str | Path) -> BatchReport:
    """Every non-blank line of the file, parsed and checked; refused lines carry their error already.
    A file that cannot be read at all raises InvalidInput (nothing of it is tried)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidInput(f"--jsonl needs a file of JSON lines: {path} is not a file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidInput(f"cannot read {path}: {exc}") from exc
    report = BatchReport()
    # decoded line by line: a byte that is not UTF-8 refuses its own line, not the file
    for i, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        fate = LineFate(i)
        report.lines.append(fate)
        try:
            raw = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            fate.refuse(InvalidInput(f"{path}:{i}: not UTF-8 ({exc})"))
            continue
        try:
            d = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            fate.refuse(InvalidInput(f"{path}:{i}: not JSON ({type(exc).__name__}: {str(exc)[:200]})"))
            continue
        if not isinstance(d, dict):
            fate.refuse(InvalidInput(f"{path}:{i}: not a JSON object"))
            continue
        fate.item = d
        try:
            check_item(d)
        except InvalidInput as exc:
            fate.refuse(InvalidInput(f"{path}:{i}: {exc}"))
    if not report.lines:
        raise InvalidInput(f"{path} holds no JSON lines")
    return report


def remember_lines(mem, report: BatchReport, *, describe, defaults: dict | None = None,
                   progress: bool = False) -> BatchReport:
    """Remember every line still pending in one batch (`KVMemory.remember_many`: memory/many.py), with
    `defaults` for the fields a line leaves out; `describe(entry) -> dict` is the caller's report of a
    remembered entry. A line refused there (its verifier, its proof, the store) is refused alone."""
    todo = report.pending
    fates = mem.remember_many([f.item for f in todo], progress=progress, **(defaults or {}))
    for line, fate in zip(todo, fates):
        if fate.ok:
            line.result = describe(fate.entry)
            line.status = "remembered"
        else:
            line.refuse(fate.error)
    return report
