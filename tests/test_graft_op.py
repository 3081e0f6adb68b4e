"""Tests of kvmemory.kernels.graft_op: the pure-PyTorch twin against a byte-walking reference, the argument
validation, the helpers, and the import-time dispatch. Exact byte equality only, never tolerances.

The reference below walks the payload with a cursor, token row by token row, in plain Python bytes:
a derivation independent of the twin's prefix arithmetic and tensor views.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import zlib

import pytest
import torch

from kvmemory.kernels import graft_op
from kvmemory.kernels.graft_op import (GraftOpUnavailable, graft_copy, pack_payload, payload_nbytes, pinned_staging, twin_graft_copy)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SENTINEL = 0xA5

# NaN payloads (quiet and signalling, with payload bits, both signs), infinities and -0.0, per dtype.
SPECIAL_BITS = {
    torch.float32: [0x7FC00001, 0x7F800001, 0xFFC12345, 0x7FFFFFFF, 0x80000000, 0x7F800000],
    torch.bfloat16: [0x7FC1, 0x7F81, 0xFFC3, 0x7FFF, 0x8000, 0xFF80],
    torch.float16: [0x7E01, 0x7C01, 0xFE55, 0x7FFF, 0x8000, 0xFC00],
}
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _to_signed(bits: int, nbits: int) -> int:
    return bits - (1 << nbits) if bits >= 1 << (nbits - 1) else bits


def random_staging(nbytes: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bits (so NaNs with random payloads occur naturally) plus explicit special patterns."""
    st = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    es = torch.empty((), dtype=dtype).element_size()
    n_el = nbytes // es
    if n_el:
        ints = st[: n_el * es].view(INT_VIEW[dtype])
        idx = torch.randint(0, n_el, (max(1, n_el // 16),), generator=gen)
        pats = torch.tensor([_to_signed(b, es * 8) for b in SPECIAL_BITS[dtype]], dtype=INT_VIEW[dtype])
        ints[idx] = pats[torch.arange(idx.numel()) % pats.numel()]
    return st


def sentinel_cache(shapes: list[tuple[int, int, int]], dtype: torch.dtype) -> list[torch.Tensor]:
    out = []
    for h, s, d in shapes:
        t = torch.empty(1, h, s, d, dtype=dtype)
        t.view(torch.uint8).fill_(SENTINEL)
        out.append(t)
    return out


def reference(staging: torch.Tensor, offsets, positions, tokens, dst_k, dst_v, dst_offsets=None):
    """Byte-walking reference: returns new (K, V) lists; the inputs are left untouched."""
    src = bytes(staging.numpy().tobytes())
    es = dst_k[0].element_size()
    offs = dst_offsets or [0] * len(dst_k)
    out_k = [bytearray(t.view(torch.uint8).numpy().tobytes()) for t in dst_k]
    out_v = [bytearray(t.view(torch.uint8).numpy().tobytes()) for t in dst_v]
    for o, p, T in zip(offsets, positions, tokens):
        cursor = o
        for li in range(len(dst_k)):
            for t, out in ((dst_k[li], out_k[li]), (dst_v[li], out_v[li])):
                _, H, S, D = t.shape
                rb = D * es
                for h in range(H):
                    for j in range(T):
                        row = p - offs[li] + j
                        if 0 <= row < S:
                            s0 = cursor + (h * T + j) * rb
                            d0 = (h * S + row) * rb
                            out[d0:d0 + rb] = src[s0:s0 + rb]
                cursor += H * T * rb

    def back(bufs, like):
        return [torch.frombuffer(bytearray(b), dtype=torch.uint8).view(x.dtype).view(x.shape).clone()
                if len(b) else x.clone() for b, x in zip(bufs, like)]

    return back(out_k, dst_k), back(out_v, dst_v)


def assert_bytes_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.cpu().view(torch.uint8), w.cpu().view(torch.uint8)), f"layer {i} differs"


def layout_nbytes(shapes, T, es, v_shapes=None) -> int:
    return T * sum(h * d * es for h, _, d in list(shapes) + list(v_shapes or shapes))


# ---------------------------------------------------------------------------------------------------
# Grid: dtypes x head dims x unaligned token counts


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("T", [1, 7, 63, 64])
def test_twin_matches_reference_grid(dtype, head_dim, T):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype}-{head_dim}-{T}".encode()))
    es = torch.empty((), dtype=dtype).element_size()
    # Two layers with different head counts; a chain of 3 blocks at positions 0, T, 2T, with an odd
    # gap between payloads so offsets are unaligned for every element size.
    shapes = [(2, 3 * T + 5, head_dim), (1, 3 * T + 5, head_dim)]
    nb = layout_nbytes(shapes, T, es)
    offsets = [3, 3 + nb + 5, 3 + 2 * nb + 11]
    positions = [0, T, 2 * T]
    staging = random_staging(offsets[-1] + nb + 7, dtype, gen)
    k, v = sentinel_cache(shapes, dtype), sentinel_cache(shapes, dtype)
    want_k, want_v = reference(staging, offsets, positions, [T] * 3, k, v)
    twin_graft_copy(staging, offsets, positions, [T] * 3, k, v)
    assert_bytes_equal(k, want_k)
    assert_bytes_equal(v, want_v)
    # Rows after the chain are untouched sentinel bytes.
    for t in k + v:
        assert bool((t[0, :, 3 * T:].contiguous().view(torch.uint8) == SENTINEL).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_nan_payloads_and_negative_zero_survive(dtype):
    """Every special bit pattern lands exactly (a value copy could quiet or canonicalise NaNs)."""
    es = torch.empty((), dtype=dtype).element_size()
    pats = SPECIAL_BITS[dtype]
    H, T, D = 1, 1, len(pats)
    ints = torch.tensor([_to_signed(b, es * 8) for b in pats] * 2, dtype=INT_VIEW[dtype])
    staging = ints.view(torch.uint8).clone()
    k, v = sentinel_cache([(H, 4, D)], dtype), sentinel_cache([(H, 4, D)], dtype)
    twin_graft_copy(staging, [0], [2], [T], k, v)
    assert torch.equal(k[0][0, 0, 2].view(INT_VIEW[dtype]), ints[:D])
    assert torch.equal(v[0][0, 0, 2].view(INT_VIEW[dtype]), ints[D:])
    assert bool(k[0][0, 0, 2].isnan().any())


def test_per_layer_offsets_skip_rows_outside():
    """Sliding-window style: layer 1 keeps only positions [10, 10 + 6); rows outside are skipped on
    both ends, layer 0 receives everything, layer 2 (window past the block) receives nothing."""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(7)
    shapes = [(2, 40, 64), (2, 6, 64), (1, 8, 128)]
    offs = [0, 10, 30]
    T = 7
    nb = layout_nbytes(shapes, T, 2)
    offsets, positions = [0, nb, 2 * nb], [7, 14, 21]
    staging = random_staging(3 * nb, dtype, gen)
    k, v = sentinel_cache(shapes, dtype), sentinel_cache(shapes, dtype)
    want_k, want_v = reference(staging, offsets, positions, [T] * 3, k, v, offs)
    graft_copy(staging, offsets, positions, [T] * 3, k, v, dst_offsets=offs)
    assert_bytes_equal(k, want_k)
    assert_bytes_equal(v, want_v)
    # Layer 1 got absolute positions 10..15 = rows 0..5 (from blocks 0 and 1), layer 2 nothing.
    assert not bool((k[1].view(torch.uint8) == SENTINEL).all())
    assert bool((k[2].view(torch.uint8) == SENTINEL).all())
    assert bool((v[2].view(torch.uint8) == SENTINEL).all())


@pytest.mark.parametrize("seed", range(24))
def test_twin_matches_reference_random_layouts(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dtype = rng.choice(DTYPES)
    es = torch.empty((), dtype=dtype).element_size()
    L = rng.randint(1, 3)
    D = rng.choice([64, 80, 128, 256])
    n_blocks = rng.randint(1, 4)
    tokens = [rng.choice([1, 2, 5, 16, 17, 33]) for _ in range(n_blocks)]
    positions, p = [], rng.randint(0, 5)
    for t in tokens:
        positions.append(p)
        p += t + rng.choice([0, 0, 3])  # chains are usually contiguous; gaps allowed
    seq = p + rng.randint(-6, 4)
    shapes = [(rng.randint(1, 3), max(seq, 1), rng.choice([D, D, 64])) for _ in range(L)]
    offs = [rng.choice([0, 0, rng.randint(0, 12)]) for _ in range(L)]
    offsets, cur = [], rng.randint(0, 9)
    for t in tokens:
        offsets.append(cur)
        cur += layout_nbytes(shapes, t, es) + rng.randint(0, 17)
    order = list(range(n_blocks))
    rng.shuffle(order)  # block order in the call does not matter
    offsets = [offsets[i] for i in order]
    positions = [positions[i] for i in order]
    tokens = [tokens[i] for i in order]
    staging = random_staging(cur, dtype, gen)
    k, v = sentinel_cache(shapes, dtype), sentinel_cache(shapes, dtype)
    want_k, want_v = reference(staging, offsets, positions, tokens, k, v, offs)
    graft_copy(staging, offsets, positions, tokens, k, v, dst_offsets=offs)
    assert_bytes_equal(k, want_k)
    assert_bytes_equal(v, want_v)


def test_k_and_v_may_differ_in_heads_and_head_dim():
    """K [Hk, T, Dk] then V [Hv, T, Dv] per layer (e.g. a value head dim unlike the key's)."""
    gen = torch.Generator().manual_seed(21)
    dtype = torch.bfloat16
    k_shapes, v_shapes = [(2, 30, 192), (4, 30, 64)], [(2, 30, 128), (1, 30, 80)]
    T = 9
    nb = layout_nbytes(k_shapes, T, 2, v_shapes)
    offsets, positions = [1, 1 + nb], [3, 3 + T]
    staging = random_staging(2 * nb + 1, dtype, gen)
    k, v = sentinel_cache(k_shapes, dtype), sentinel_cache(v_shapes, dtype)
    want_k, want_v = reference(staging, offsets, positions, [T, T], k, v, [0, 4])
    graft_copy(staging, offsets, positions, [T, T], k, v, dst_offsets=[0, 4])
    assert_bytes_equal(k, want_k)
    assert_bytes_equal(v, want_v)
    assert payload_nbytes(k, v, T) == nb
    # With zero offsets every row lands, and pack_payload gives the payload back byte for byte.
    k0, v0 = sentinel_cache(k_shapes, dtype), sentinel_cache(v_shapes, dtype)
    graft_copy(staging, offsets, positions, [T, T], k0, v0)
    assert torch.equal(pack_payload(k0, v0, 3, T), staging[1:1 + nb])
    assert torch.equal(pack_payload(k0, v0, 3 + T, T), staging[1 + nb:1 + 2 * nb])


def test_pack_payload_round_trip():
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float16
    shapes = [(2, 20, 64), (3, 20, 96)]
    truth_k = [random_staging(h * s * d * 2, dtype, gen).view(dtype).view(1, h, s, d) for h, s, d in shapes]
    truth_v = [random_staging(h * s * d * 2, dtype, gen).view(dtype).view(1, h, s, d) for h, s, d in shapes]
    parts = [pack_payload(truth_k, truth_v, 0, 16), pack_payload(truth_k, truth_v, 16, 4)]
    assert parts[0].numel() == payload_nbytes(truth_k, truth_v, 16)
    assert parts[1].numel() == payload_nbytes(truth_k, truth_v, 4)
    staging = torch.cat(parts)
    k, v = sentinel_cache(shapes, dtype), sentinel_cache(shapes, dtype)
    graft_copy(staging, [0, parts[0].numel()], [0, 16], [16, 4], k, v)
    assert_bytes_equal(k, truth_k)
    assert_bytes_equal(v, truth_v)
    with pytest.raises(ValueError, match="outside"):
        pack_payload(truth_k, truth_v, 18, 4)


def test_empty_chain_is_a_no_op():
    k, v = sentinel_cache([(1, 4, 64)], torch.float32), sentinel_cache([(1, 4, 64)], torch.float32)
    graft_copy(torch.empty(0, dtype=torch.uint8), [], [], [], k, v)
    assert bool((k[0].view(torch.uint8) == SENTINEL).all())


# ---------------------------------------------------------------------------------------------------
# Validation: clear ValueErrors, raised before any byte is copied


def _valid_args():
    shapes = [(2, 16, 64), (2, 16, 64)]
    dtype = torch.bfloat16
    nb = layout_nbytes(shapes, 8, 2)
    staging = torch.zeros(2 * nb, dtype=torch.uint8)
    staging[:] = 0x11
    return dict(
        staging=staging, block_offsets=[0, nb], block_positions=[0, 8], block_tokens=[8, 8],
        dst_k=sentinel_cache(shapes, dtype), dst_v=sentinel_cache(shapes, dtype), dst_offsets=None,
    )


def _bad(**changes):
    def make():
        args = _valid_args()
        for key, fn in changes.items():
            args[key] = fn(args)
        return args
    return make


BAD_CASES = [
    ("staging must be a torch.Tensor", _bad(staging=lambda a: bytearray(10))),
    ("1-D uint8", _bad(staging=lambda a: a["staging"].view(torch.int16))),
    ("1-D uint8", _bad(staging=lambda a: a["staging"].view(2, -1))),
    ("contiguous", _bad(staging=lambda a: torch.zeros(2 * a["staging"].numel(), dtype=torch.uint8)[::2])),
    ("differ in length", _bad(block_tokens=lambda a: [8])),
    ("sequence of integers", _bad(block_offsets=lambda a: [0.0, 1.5])),
    ("not booleans", _bad(block_positions=lambda a: [False, 8])),
    ("block_tokens must be >= 1", _bad(block_tokens=lambda a: [8, 0])),
    ("block_positions must be >= 0", _bad(block_positions=lambda a: [-8, 8])),
    ("does not fit in staging", _bad(block_offsets=lambda a: [0, a["block_offsets"][1] + 1])),
    ("does not fit in staging", _bad(block_offsets=lambda a: [-1, a["block_offsets"][1]])),
    ("overlap", _bad(block_positions=lambda a: [0, 7])),
    ("non-empty and of equal length", _bad(dst_v=lambda a: a["dst_v"][:1])),
    ("non-empty and of equal length", _bad(dst_k=lambda a: [], dst_v=lambda a: [])),
    ("dst_offsets has 1 entries", _bad(dst_offsets=lambda a: [0])),
    ("dst_offsets\\[1\\] must be >= 0", _bad(dst_offsets=lambda a: [0, -1])),
    ("shape \\[1, H, S, D\\]", _bad(dst_k=lambda a: [a["dst_k"][0], a["dst_k"][1][0]])),
    ("shape \\[1, H, S, D\\]", _bad(dst_v=lambda a: [a["dst_v"][0], a["dst_v"][1].expand(2, -1, -1, -1)])),
    ("must be contiguous", _bad(dst_k=lambda a: [a["dst_k"][0], a["dst_k"][1].transpose(1, 2)])),
    ("one cache dtype", _bad(dst_v=lambda a: [a["dst_v"][0], a["dst_v"][1].view(torch.float16)])),
    ("different numbers of token rows",
     _bad(dst_v=lambda a: [a["dst_v"][0], sentinel_cache([(2, 15, 64)], torch.bfloat16)[0]])),
    ("same memory", _bad(dst_v=lambda a: [a["dst_v"][0], a["dst_k"][1]])),
    ("must be a torch.Tensor", _bad(dst_k=lambda a: [a["dst_k"][0], "x"])),
    ("sequence of Python integers", _bad(block_offsets=lambda a: torch.tensor(a["block_offsets"]))),
]


@pytest.mark.parametrize("match,make", BAD_CASES, ids=[c[0][:24] + f"-{i}" for i, c in enumerate(BAD_CASES)])
@pytest.mark.parametrize("op", [graft_copy, twin_graft_copy], ids=["graft_copy", "twin"])
def test_validation_errors_before_copying(op, match, make):
    args = make()
    with pytest.raises(ValueError, match=match):
        op(**args)
    # Nothing was copied, not even the blocks that were valid.
    for t in list(args["dst_k"]) + list(args["dst_v"]):
        if isinstance(t, torch.Tensor):
            assert bool((t.contiguous().view(torch.uint8) == SENTINEL).all())


# ---------------------------------------------------------------------------------------------------
# Dispatch, helpers


def test_impl_chosen_once_at_import():
    assert graft_op.IMPL in ("cuda", "twin")
    assert isinstance(graft_op.IMPL_REASON, str) and graft_op.IMPL_REASON
    if not torch.cuda.is_available():
        assert graft_op.IMPL == "twin"


def test_select_override_values():
    assert graft_op._select("twin")[:2] == ("twin", True)
    with pytest.raises(ValueError, match="KVMEMORY_GRAFT_OP"):
        graft_op._select("gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_forced_cuda_without_cuda_raises_clearly():
    with pytest.raises(GraftOpUnavailable, match="KVMEMORY_GRAFT_OP=cuda"):
        graft_op._select("cuda")
    with pytest.raises(GraftOpUnavailable, match="not loaded"):
        graft_op.cuda_graft_copy(**_valid_args())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_forced_cuda_env_fails_at_import():
    env = dict(os.environ, KVMEMORY_GRAFT_OP="cuda")
    proc = subprocess.run([sys.executable, "-c", "import kvmemory.kernels.graft_op"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "GraftOpUnavailable" in proc.stderr and "KVMEMORY_GRAFT_OP=cuda" in proc.stderr
    env["KVMEMORY_GRAFT_OP"] = "twin"
    proc = subprocess.run([sys.executable, "-c", "import kvmemory.kernels.graft_op as g; print(g.IMPL)"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "twin", proc.stderr


def test_pinned_staging_reuses_its_buffer():
    a = pinned_staging(1000)
    assert a.dtype == torch.uint8 and a.numel() == 1000
    b = pinned_staging(5000)
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    c = pinned_staging(10, slot=1)
    assert c.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    big = pinned_staging(3 << 20)
    assert big.numel() == 3 << 20
    if torch.cuda.is_available():
        assert big.is_pinned()
    with pytest.raises(ValueError):
        pinned_staging(-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_twin_on_cuda_destination_from_host_staging():
    gen = torch.Generator().manual_seed(11)
    dtype = torch.bfloat16
    shapes = [(2, 20, 128), (2, 20, 128)]
    nb = layout_nbytes(shapes, 7, 2)
    staging = random_staging(2 * nb + 3, dtype, gen)
    k, v = sentinel_cache(shapes, dtype), sentinel_cache(shapes, dtype)
    want_k, want_v = reference(staging, [3, 3 + nb], [0, 7], [7, 7], k, v)
    kc, vc = [t.cuda() for t in k], [t.cuda() for t in v]
    twin_graft_copy(staging, [3, 3 + nb], [0, 7], [7, 7], kc, vc)
    assert_bytes_equal(kc, want_k)
    assert_bytes_equal(vc, want_v)
