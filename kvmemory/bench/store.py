"""`kvmemory bench store`: block write / read throughput against a raw copy of the same bytes.

On the same disk, with payloads of the default model's block size: writing blocks through the store
(header + payload, fsync, atomic rename, catalogue rows) vs writing the same bytes to plain files
with fsync; reading blocks through the store (read + SHA-256 verification against the catalogue) vs
plain reads of the same files, and vs plain reads + SHA-256; the cost of SHA-256 alone; each at
1, 2 and 4 threads. Where the lanes' SHA-256 runs (sha256_lanes.py: AVX-512 or SHA-NI), also the
store's grouped read (`read_blocks_lanes`: 16 blocks per call, read into 16 KB segments and hashed
there, as a graft reads) and the lanes' hash alone. Reads are from the page cache (files just written), as in regular use, into one
preallocated destination for both the store and the plain reads.
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvmemory.kernels import sha256_lanes
from kvmemory.store.blocks import BlockMeta, chain_hash
from kvmemory.store.local import LocalStore

# SmolLM2-135M: 30 layers x (K+V) x 3 heads x 64 tokens x 64 dims x 4 bytes.
DEFAULT_BLOCK_BYTES = 30 * 2 * 3 * 64 * 64 * 4


def _metas(n: int, block_bytes: int, seed: int) -> list[tuple[BlockMeta, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out, parent = [], None
    pid = hashlib.sha256(b"bench-store").hexdigest()
    elems = block_bytes // 4
    for i in range(n):
        toks = torch.randint(0, 50000, (64,), generator=g).tolist()
        h = chain_hash(pid, parent, toks)
        payload = torch.randint(0, 256, (block_bytes,), dtype=torch.uint8, generator=g)
        meta = BlockMeta(hash=h, parent=parent, profile_id=pid, index=i, position=64 * i, token_ids=tuple(toks),
                         dtype="float32", k_shapes=((1, 64, elems // 128),), v_shapes=((1, 64, elems // 128),),
                         payload_nbytes=block_bytes,
                         payload_sha256=hashlib.sha256(memoryview(payload.numpy())).hexdigest())
        out.append((meta, payload))
        parent = h
    return out


def _run(threads: int, fn, items) -> float:
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fn, items))
    return time.perf_counter() - t


def run_store_bench(blocks: int = 64, block_bytes: int = DEFAULT_BLOCK_BYTES, threads=(1, 2, 4),
                    folder: str | None = None, seed: int = 0, repeats: int = 5) -> dict:
    tmp = tempfile.TemporaryDirectory(prefix="kvmemory-bench-store-", dir=folder)
    try:
        items = _metas(blocks, block_bytes, seed)
        total = blocks * block_bytes
        results = []
        for th in threads:
            store = LocalStore(os.path.join(tmp.name, f"store-{th}"))
            raw_dir = os.path.join(tmp.name, f"raw-{th}")
            os.makedirs(raw_dir)

            def raw_write(item):
                meta, payload = item
                with open(os.path.join(raw_dir, meta.hash), "wb") as fh:
                    fh.write(memoryview(payload.numpy()))
                    fh.flush()
                    os.fsync(fh.fileno())

            t_raw_w = _run(th, raw_write, items)
            t0 = time.perf_counter()
            _run(th, lambda it: store.write_block_file(*it), items)
            store.put_blocks(items)  # catalogue rows (files exist: not rewritten)
            t_store_w = time.perf_counter() - t0
            rows = [store.get_block(m.hash) for m, _ in items]

            # Both read into the same preallocated destination, one slice per block, as a graft reads
            # into its cache: allocation and page faults are not what is compared.
            dest = memoryview(bytearray(total))
            slot = {m.hash: dest[i * block_bytes : (i + 1) * block_bytes] for i, (m, _) in enumerate(items)}

            def raw_read(meta):
                buf = slot[meta.hash]
                with open(os.path.join(raw_dir, meta.hash), "rb", buffering=0) as fh:
                    got = 0
                    while got < len(buf):
                        got += fh.readinto(buf[got:]) or len(buf)
                return buf

            def store_read(row):
                return store.read_block(row, into=slot[row.hash])

            # The grouped read, grouped as a graft groups (any group size: the tiny test runs 4 blocks).
            lanes = sha256_lanes.load() is not None and block_bytes % 64 == 0
            groups = sha256_lanes.groups(rows, th, min_lanes=1)
            seg = math.gcd(block_bytes, 1 << 14)
            dest_np = np.frombuffer(dest, dtype=np.uint8)
            starts = {m.hash: dest_np.ctypes.data + i * block_bytes for i, (m, _) in enumerate(items)}

            def place(meta):  # the block's slice of the destination, in 16 KB segments
                return starts[meta.hash] + np.arange(block_bytes // seg, dtype=np.uint64) * np.uint64(seg), seg

            def store_read_lanes(group):
                out = store.read_blocks_lanes(group, place)
                assert not any(isinstance(m, Exception) for m in out), out

            payload_groups = [[memoryview(p.numpy()) for _, p in items[i : i + sha256_lanes.LANES]]
                              for i in range(0, blocks, sha256_lanes.LANES)]

            # Reads are short: the median of `repeats` runs, interleaved so drift hits each the same.
            reads = {"raw": [], "raw_sha": [], "store": [], "sha": [], "store_lanes": [], "sha_lanes": []}
            for _ in range(repeats):
                reads["raw"].append(_run(th, lambda it: raw_read(it[0]), items))
                reads["raw_sha"].append(_run(th, lambda it: hashlib.sha256(raw_read(it[0])).digest(), items))
                reads["store"].append(_run(th, store_read, rows))
                reads["sha"].append(_run(th, lambda it: hashlib.sha256(memoryview(it[1].numpy())).digest(), items))
                if lanes:
                    reads["store_lanes"].append(_run(th, store_read_lanes, groups))
                    reads["sha_lanes"].append(_run(th, sha256_lanes.sha256_many, payload_groups))
            t_raw_r, t_raw_rh, t_store_r, t_hash = (statistics.median(reads[k]) for k in ("raw", "raw_sha", "store", "sha"))
            gb = total / 1e9
            t_lanes_r = statistics.median(reads["store_lanes"]) if lanes else None
            t_lanes_h = statistics.median(reads["sha_lanes"]) if lanes else None
            results.append({
                "threads": th,
                "write_store_gb_s": gb / t_store_w, "write_raw_gb_s": gb / t_raw_w,
                "write_ratio": t_raw_w / t_store_w,
                "read_verified_store_gb_s": gb / t_store_r, "read_raw_gb_s": gb / t_raw_r,
                "read_raw_plus_sha256_gb_s": gb / t_raw_rh,
                "read_ratio_vs_raw_plus_sha256": t_raw_rh / t_store_r, "read_ratio_vs_raw": t_raw_r / t_store_r,
                "sha256_only_gb_s": gb / t_hash,
                # None where the multi-lane SHA-256 cannot run here
                "read_verified_store_lanes_gb_s": gb / t_lanes_r if lanes else None,
                "sha256_lanes_only_gb_s": gb / t_lanes_h if lanes else None,
                # every read's seconds (medians above; the spread is theirs), the writes timed once each
                "read_samples_s": {k: v for k, v in reads.items() if v},
                "write_samples_s": {"store": [t_store_w], "raw": [t_raw_w]},
            })
            store.close()
        from kvmemory.bench.graft import machine_info

        return {"blocks": blocks, "block_bytes": block_bytes, "total_bytes": total, "folder": tmp.name,
                "repeats": repeats, "machine": machine_info(), "results": results}
    finally:
        tmp.cleanup()


def format_table(r: dict) -> str:
    def gbs(v):
        return "n/a" if v is None else f"{v:.2f}"

    out = ["| threads | write store GB/s | write raw GB/s | read+verify store GB/s | read raw GB/s | "
           "read raw+SHA GB/s | SHA-256 only GB/s | store read / (raw+SHA) | read+verify store, lanes GB/s | "
           "SHA-256 lanes only GB/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["results"]:
        out.append(f"| {x['threads']} | {x['write_store_gb_s']:.2f} | {x['write_raw_gb_s']:.2f} | "
                   f"{x['read_verified_store_gb_s']:.2f} | {x['read_raw_gb_s']:.2f} | {x['read_raw_plus_sha256_gb_s']:.2f} "
                   f"| {x['sha256_only_gb_s']:.2f} | {x['read_ratio_vs_raw_plus_sha256']:.0%} | "
                   f"{gbs(x['read_verified_store_lanes_gb_s'])} | {gbs(x['sha256_lanes_only_gb_s'])} |")
    return "\n".join(out)
