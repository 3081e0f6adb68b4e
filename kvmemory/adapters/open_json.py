"""A JSON object with no schema but "an object" (`response_format: {"type": "json_object"}`, or a
schema's `{"type": "object"}` without properties): the model writes the keys and chooses each value's
kind, the guide writes the punctuation, so the result always parses as one JSON object.

Per key: `"` is written, the model decodes the key up to its closing quote; after `:` one forward
gives the logits of the next token, and the kind of value (string, number, true, false, null, an
object, an array) is the one whose likeliest token is likeliest there (a token belongs to a kind by
its text: `"...` a string, `3` / `-` a number, `t` / `tr` / `true` true, ...); the value is then
written as `JsonGuide` writes a typed one. After each value the same comparison between `,` and `}`
says whether the model goes on. A key the model leaves empty or repeats ends the object before it
(the text goes back to the last value); so does the budget, or `MAX_KEYS`.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from kvmemory.adapters.errors import GuidedDecodingError

MAX_KEYS = 16
MAX_DEPTH = 2  # open objects nest at most this deep (deeper ones are closed as {})
_KEY_TOKENS = 16
_STRING_SHARES = 4  # an open object's string takes at most remaining/4 of the budget
_LITERALS = {"true": True, "false": False, "null": None}
_tables: dict[int, dict[str, torch.Tensor]] = {}


def token_kinds(tokenizer) -> dict[str, torch.Tensor]:
    """kind -> bool mask over the vocabulary: the tokens whose text (after leading spaces) starts a
    value of that kind, or a `,` / `}` after one. Built once per tokenizer."""
    key = id(tokenizer)
    if key not in _tables:
        n = len(tokenizer)
        texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=True)
        kinds = {k: torch.zeros(n, dtype=torch.bool) for k in ("string", "number", "object", "array", ",", "}",
                                                              *_LITERALS)}
        for i, t in enumerate(texts):
            s = t.lstrip(" \t\n")
            if not s:
                continue
            c = s[0]
            if c == '"':
                kinds["string"][i] = True
            elif c in "-0123456789":
                kinds["number"][i] = True
            elif c == "{":
                kinds["object"][i] = True
            elif c == "[":
                kinds["array"][i] = True
            elif c in ",}":
                kinds[c][i] = True
            else:
                for word in _LITERALS:
                    if word.startswith(s) or s.startswith(word):
                        kinds[word][i] = True
        _tables[key] = kinds
    return _tables[key]


def _likeliest(logits: torch.Tensor, kinds: dict[str, torch.Tensor], allowed: list[str]) -> str:
    best, pick = None, allowed[0]
    for k in allowed:
        mask = kinds[k]
        n = min(mask.numel(), logits.numel())
        row = logits[:n][mask[:n]]
        if row.numel() and (best is None or float(row.max()) > best):
            best, pick = float(row.max()), k
    return pick


def open_object(g: Any, depth: int) -> dict:
    """Write one JSON object whose keys and values the model chooses (module docstring); `g`: the
    guided.JsonGuide writing the value (not imported here: guided imports this module)."""
    d = g.d
    kinds = token_kinds(d.memory.engine.tokenizer)
    out: dict[str, Any] = {}
    g._write("{")
    if depth >= MAX_DEPTH:
        g._write("}")
        return out
    g.strings_left = max(g.strings_left, _STRING_SHARES)
    while len(out) < MAX_KEYS and g.remaining > 0:
        before = g.text
        g._write(('"' if not out else ', "'))
        raw = g._decode(['"', "\n"], _KEY_TOKENS)
        key = raw.strip()
        if not key or key in out or "\n" in raw:
            g.text = before  # no key, or one already written: the object ends at the last value
            break
        g.text += json.dumps(key, ensure_ascii=False)[1:] + ":"
        allowed = ["string", "number", *_LITERALS, "array"] + (["object"] if depth + 1 < MAX_DEPTH else [])
        kind = _likeliest(d.next_logits(g.text), kinds, allowed)
        g.text += " "
        if kind == "string":
            out[key] = g._string()
        elif kind == "number":
            out[key] = g._number("number")
        elif kind in _LITERALS:
            g._write(kind)
            out[key] = _LITERALS[kind]
        elif kind == "array":
            out[key] = g._array({})
        else:
            out[key] = open_object(g, depth + 1)
        if g.remaining <= 0:
            g.truncated = True
            break
        if _likeliest(d.next_logits(g.text), kinds, [",", "}"]) == "}":
            break
    if not out:
        raise GuidedDecodingError("the model wrote no key for the JSON object")
    g._write("}")
    return out
