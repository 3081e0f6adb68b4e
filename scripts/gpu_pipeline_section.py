"""scripts/gpu_check.py's `pipelined_graft` section (issue 39, item 2): the pipelined graft at the 8B shape.

Llama-3.1-8B's K/V layout (32 layers, 8 KV heads, head dim 128, bfloat16, grid C = 64: 8 MiB a block),
chains of 8k and 32k tokens (1.07 GB and 4.29 GB of payload) written into a LocalStore on this
machine's disk (so the page cache is warm), grafted by kvmemory.engine.pipeline into a one-tensor
cache on the GPU, on the current stream, with no model (the runner's shapes are given):

- h2d_peak: one copy_ of the 32k chain's bytes from pinned host memory to the GPU, the link's rate;
  the floor of a graft is bytes / that rate;
- cold: the tier keeps nothing (budget 0): every block is read and SHA-256-verified on every core into
  pinned slots and copied by the graft kernel once its group is verified, overlapped;
- hot: the verified-once tier holds the chain in pinned memory: copied without a read or a hash;
- read_hash_raw: the readers' own rate (the lanes kernel on every core: read and hash, nothing stored,
  no catalogue): what a cold graft cannot beat;
- cold with the other lanes build (SHA-NI, one lane at a time, finer groups) where the CPU runs both;
- equality: after every graft the cache's bytes equal the payloads placed at their positions
  (torch.equal, both tiers);
- damage: a byte flipped in block 64 of the 8k chain: the graft stops before it, the block is
  quarantined, blocks 0-63 equal.

With --dry-run: tiny shapes on the CPU (the graft op's twin copies), every step the same.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _spread(samples: list[float], nbytes: int) -> dict:
    med = statistics.median(samples)
    return {"min_s": round(min(samples), 5), "median_s": round(med, 5), "max_s": round(max(samples), 5),
            "GBps_median": round(nbytes / med / 1e9, 2), "GBps_best": round(nbytes / min(samples) / 1e9, 2)}


def section_pipelined_graft(rec: dict, args, graft_op, state: dict, device: torch.device,
                            deadline: float | None = None) -> None:
    from kvmemory.engine import pipeline
    from kvmemory.engine.graft import GraftReport
    from kvmemory.engine.tier import VerifiedTier
    from kvmemory.kernels import sha256_lanes
    from kvmemory.store.blocks import BlockMeta, chain_hash
    from kvmemory.store.local import LocalStore

    cuda = device.type == "cuda"
    if cuda:
        layers, heads, dim, C, lengths = 32, 8, 128, 64, [8192, 32768]
        if graft_op.IMPL != "cuda":
            raise RuntimeError(f"the graft op is not the kernel here: {graft_op.IMPL_REASON}")
    else:
        layers, heads, dim, C, lengths = 2, 2, 64, 16, [256, 1024]
        pipeline.CPU_READERS_COPY = False  # the GPU's flow: the caller copies each group in chain order
    dtype, esize = torch.bfloat16, 2
    reps = 2 if args.quick else 3
    block = C * layers * 2 * heads * dim * esize
    n_max = max(lengths) // C
    where = "pinned" if cuda else "cpu"
    rec.update(layout={"layers": layers, "kv_heads": heads, "head_dim": dim, "chunk": C, "dtype": "bfloat16",
                       "block_bytes": block}, lengths=lengths, graft_op=graft_op.IMPL,
               readers=pipeline.READERS, lanes_build=pipeline.lanes_build(), page_cache="warm (just written)")
    print(f"  {n_max} blocks of {block / 2**20:.2f} MiB; readers {pipeline.READERS}, lanes {rec['lanes_build']}")

    # The chain: random payloads (made on the device: fast), their digests (hashlib, every core), files.
    gen = torch.Generator(device=device).manual_seed(39)
    src = torch.randint(0, 256, (n_max * block,), dtype=torch.uint8, device=device, generator=gen)
    host = src.cpu() if cuda else src
    tmp = tempfile.TemporaryDirectory(dir=args.tmpdir, prefix="kvm-pipeline-")
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            shas = list(pool.map(lambda i: hashlib.sha256(host[i * block:(i + 1) * block].numpy()).hexdigest(),
                                 range(n_max)))
        store = LocalStore(Path(tmp.name) / "store")
        pid, parent, metas = "39" * 32, None, []
        for i in range(n_max):
            ids = tuple(range(i * C, (i + 1) * C))
            h = chain_hash(pid, parent, ids)
            metas.append(BlockMeta(h, parent, pid, i, i * C, ids, "bfloat16", ((heads, C, dim),) * layers,
                                   ((heads, C, dim),) * layers, block, shas[i]))
            parent = h
        for k in range(0, n_max, 64):
            store.put_blocks([(m, host[m.index * block:(m.index + 1) * block]) for m in metas[k:k + 64]])
        known = store.known_blocks([m.hash for m in metas])
        rows = [known[m.hash] for m in metas]
        rec["store_seconds"] = round(time.perf_counter() - t0, 2)
        runner = SimpleNamespace(device=device, kv_dtype=dtype, sliding_windows=[None] * layers,
                                 full_attention_only=True)

        def graft(nb: int, tier) -> tuple[float, object, GraftReport]:
            rep = GraftReport()
            _sync(device)
            t = time.perf_counter()
            chain = pipeline.load_pipelined(store, rows[:nb], rep, runner, nb * C + C, None, tier)
            _sync(device)
            return time.perf_counter() - t, chain, rep

        def equal(chain, nb: int) -> bool:
            """The cache [layers, K|V, H, S, D] holds payload i at positions [i*C, (i+1)*C), byte for byte."""
            got = chain.cache.whole.view(torch.uint8)[:, :, :, : nb * C]
            want = src[: nb * block].view(nb, layers, 2, heads, C, dim * esize).permute(1, 2, 3, 0, 4, 5)
            return torch.equal(got, want.reshape(layers, 2, heads, nb * C, dim * esize))

        def raw_read_hash(nb: int) -> float | None:
            """GB/s of the readers alone: each group's files read and hashed by the lanes kernel, no store."""
            build, seg = pipeline.lanes_build(), pipeline.segment_bytes(block)
            if build is None or seg is None:
                return None
            groups = pipeline.plan_groups(list(range(nb)), pipeline.READERS, build)
            paths = [store.block_path(m.hash) for m in metas[:nb]]
            offs = [os.path.getsize(p) - block for p in paths]

            def one(g):
                got, _ = sha256_lanes.read_hash_lanes([paths[i] for i in g], [offs[i] for i in g], None, seg,
                                                      nseg=block // seg)
                return sum(got)

            t = time.perf_counter()
            n = sum(pipeline.readers().map(one, groups))
            return round(n / (time.perf_counter() - t) / 1e9, 2)

        # The link's peak: the largest chain's bytes in one copy from pinned memory.
        peak = None
        if cuda:
            pinned = torch.empty(n_max * block, dtype=torch.uint8, pin_memory=True)
            pinned.copy_(host)
            flat = torch.empty_like(src)
            times = []
            for _ in range(reps + 1):
                _sync(device)
                t = time.perf_counter()
                flat.copy_(pinned, non_blocking=True)
                _sync(device)
                times.append(time.perf_counter() - t)
            peak = _spread(times[1:], n_max * block)
            rec["h2d_peak"] = peak
            del pinned, flat
            print(f"  pinned H2D peak {peak['GBps_best']} GB/s")

        results, all_equal = {}, True
        for L in lengths:
            nb = L // C
            nbytes = nb * block
            r: dict = {"blocks": nb, "bytes": nbytes}
            if peak is not None:
                r["floor_s"] = round(nbytes / (peak["GBps_best"] * 1e9), 5)
            if deadline is not None and time.monotonic() > deadline:
                r["skipped"] = "the section's time budget was spent"
                results[L] = r
                continue
            r["read_hash_raw_GBps"] = raw_read_hash(nb)
            cold_tier = VerifiedTier(0, where)
            samples, eq = [], True
            for k in range(reps + 1):  # the first allocates the arenas (pinning), untimed
                s, chain, rep = graft(nb, cold_tier)
                eq &= len(chain.metas) == nb and equal(chain, nb)
                if k:
                    samples.append(s)
            r["cold"] = _spread(samples, nbytes)
            r["cold"]["read_verify_launch_s_last"] = round(rep.read_verify_seconds, 5)
            r["cold"]["equal"] = eq
            hot_tier = VerifiedTier(nbytes + block, where)
            s, chain, rep = graft(nb, hot_tier)  # admits the chain
            r["admit_s"] = round(s, 5)
            samples, eqh = [], len(chain.metas) == nb and equal(chain, nb)
            for _ in range(reps):
                s, chain, rep = graft(nb, hot_tier)
                eqh &= rep.blocks_from_tier == nb and equal(chain, nb)
                samples.append(s)
            r["hot"] = _spread(samples, nbytes)
            r["hot"]["equal"] = eqh
            if peak is not None:
                r["cold_over_floor"] = round(r["cold"]["median_s"] / r["floor_s"], 2)
                r["hot_over_floor"] = round(r["hot"]["median_s"] / r["floor_s"], 2)
            hot_tier.clear()
            del hot_tier, chain
            # The other lanes build, where this CPU runs it too: SHA-NI, one lane at a time, finer groups.
            if rec["lanes_build"] == "avx512" and sha256_lanes.builds_here().get("sha-ni"):
                old = os.environ.get("KVMEMORY_SHA256_LANES")
                os.environ["KVMEMORY_SHA256_LANES"] = "sha-ni"
                sha256_lanes.KERNEL_LIB.forget()
                try:
                    samples = []
                    for k in range(reps + 1):
                        s, chain, _ = graft(nb, cold_tier)
                        eq &= len(chain.metas) == nb and equal(chain, nb)
                        if k:
                            samples.append(s)
                    r["cold_sha_ni"] = _spread(samples, nbytes)
                    r["read_hash_raw_sha_ni_GBps"] = raw_read_hash(nb)
                finally:
                    if old is None:
                        os.environ.pop("KVMEMORY_SHA256_LANES", None)
                    else:
                        os.environ["KVMEMORY_SHA256_LANES"] = old
                    sha256_lanes.KERNEL_LIB.forget()
            cold_tier.clear()
            all_equal &= eq and eqh
            results[L] = r
            print(f"  L={L}: cold {r['cold']['median_s']:.4f} s ({r['cold']['GBps_median']} GB/s), hot "
                  f"{r['hot']['median_s']:.4f} s ({r['hot']['GBps_median']} GB/s), floor {r.get('floor_s')}, "
                  f"raw read+hash {r['read_hash_raw_GBps']} GB/s, equal {eq and eqh}")
        rec["results"] = results

        # A damaged block in the middle of the 8k chain: cut before it, quarantined, the rest equal.
        nb = lengths[0] // C
        bad = nb // 2
        path = store.block_path(rows[bad].hash)
        data = bytearray(path.read_bytes())
        data[-block // 3] ^= 0x20
        path.write_bytes(bytes(data))
        s, chain, rep = graft(nb, VerifiedTier(0, where))
        rec["damage"] = {"block": bad, "grafted_blocks": len(chain.metas),
                         "quarantined": rep.quarantined == [rows[bad].hash],
                         "equal_before": len(chain.metas) == bad and equal(chain, bad),
                         "store_marks_it": store.get_block(rows[bad].hash).quarantined}
        print(f"  damage: {rec['damage']}")
        ok = all_equal and all(rec["damage"][k] for k in ("quarantined", "equal_before", "store_marks_it"))
        ok &= rec["damage"]["grafted_blocks"] == bad
        rec["all_equal"] = all_equal
        if not ok:
            rec["ok_override"] = False
        store.close()
    finally:
        tmp.cleanup()
