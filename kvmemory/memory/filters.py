"""Metadata filters: the `where={...}` of `KVMemory.list` and `KVMemory.recall` (and the `filter=` of
the LangGraph store, which uses the same semantics on an item's value).

A filter is a dict of key -> condition, all of which must hold:

    {"user": "alice"}                       equality (a value that is a dict compares as nested filters)
    {"score": {"$gte": 3, "$lt": 10}}       operators: $eq $ne $gt $gte $lt $lte $in $nin $exists
    {"tags": ["a", "b"]}                    a list compares element by element

`check_where` validates a filter once (typed `InvalidInput` naming what is wrong), so a typo in an
operator fails at the call instead of silently matching nothing.
"""

from __future__ import annotations

from typing import Any

from kvmemory.errors import InvalidInput

OPERATORS = ("$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin", "$exists")
_ORDERED = {"$gt", "$gte", "$lt", "$lte"}


def check_where(where: Any, name: str = "where") -> dict | None:
    """`where` if it is a well-formed filter (None passes); else `InvalidInput` saying what is wrong."""
    if where is None:
        return None
    if not isinstance(where, dict):
        raise InvalidInput(f"{name} must be a dict of metadata key -> value, got {type(where).__name__}")
    for key, cond in where.items():
        if not isinstance(key, str) or not key:
            raise InvalidInput(f"{name} keys must be non-empty strings, got {key!r}")
        if key.startswith("$"):
            raise InvalidInput(f"{name}: {key!r} is an operator, not a key; write {{'field': {{{key!r}: value}}}}")
        _check_condition(cond, f"{name}[{key!r}]")
    return where


def _check_condition(cond: Any, name: str) -> None:
    if not isinstance(cond, dict):
        return
    ops = [k for k in cond if isinstance(k, str) and k.startswith("$")]
    if ops and len(ops) != len(cond):
        raise InvalidInput(f"{name} mixes operators and keys: {sorted(map(str, cond))}")
    if not ops:
        check_where(cond, name)  # a nested filter
        return
    for op, arg in cond.items():
        if op not in OPERATORS:
            raise InvalidInput(f"{name}: unknown operator {op!r}; use one of {', '.join(OPERATORS)}")
        if op in _ORDERED and (isinstance(arg, bool) or not isinstance(arg, (int, float, str))):
            raise InvalidInput(f"{name}: {op} needs a number or a string, got {arg!r}")
        if op in ("$in", "$nin") and not isinstance(arg, (list, tuple)):
            raise InvalidInput(f"{name}: {op} needs a list, got {type(arg).__name__}")
        if op == "$exists" and not isinstance(arg, bool):
            raise InvalidInput(f"{name}: $exists needs true or false, got {arg!r}")


_MISSING = object()


def matches(record: Any, where: dict | None) -> bool:
    """Whether a dict (an entry's meta, an item's value) satisfies a filter checked by `check_where`."""
    if not where:
        return True
    if not isinstance(record, dict):
        return False
    return all(_holds(record.get(k, _MISSING), cond) for k, cond in where.items())


def _holds(value: Any, cond: Any) -> bool:
    if isinstance(cond, dict):
        if cond and all(isinstance(k, str) and k.startswith("$") for k in cond):
            return all(_operator(value, op, arg) for op, arg in cond.items())
        return isinstance(value, dict) and all(_holds(value.get(k, _MISSING), c) for k, c in cond.items())
    if value is _MISSING:
        return False
    if isinstance(cond, (list, tuple)):
        return isinstance(value, (list, tuple)) and len(value) == len(cond) and all(
            _holds(a, b) for a, b in zip(value, cond))
    return _equal(value, cond)


def _equal(a: Any, b: Any) -> bool:
    # JSON has no separate bool: keep True from matching 1 (Python's True == 1), which no user means.
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _operator(value: Any, op: str, arg: Any) -> bool:
    if op == "$exists":
        return (value is not _MISSING) == arg
    if value is _MISSING:
        return op in ("$ne", "$nin")  # an absent key is "not equal" to anything
    if op == "$eq":
        return _equal(value, arg)
    if op == "$ne":
        return not _equal(value, arg)
    if op == "$in":
        return any(_equal(value, a) for a in arg)
    if op == "$nin":
        return not any(_equal(value, a) for a in arg)
    # Ordered comparisons: numbers with numbers, strings with strings; anything else does not match
    # (a string is never "greater than 3").
    if isinstance(value, bool) or isinstance(arg, bool):
        return False
    both_num = isinstance(value, (int, float)) and isinstance(arg, (int, float))
    both_str = isinstance(value, str) and isinstance(arg, str)
    if not (both_num or both_str):
        return False
    if op == "$gt":
        return value > arg
    if op == "$gte":
        return value >= arg
    if op == "$lt":
        return value < arg
    return value <= arg
