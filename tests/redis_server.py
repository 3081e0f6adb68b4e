"""Test helpers for the shared store: real Redis servers, and synthetic blocks and entries.

`RedisServer` starts one `redis-server` (and `RedisCluster` a 3-node Redis Cluster) on free loopback
ports in a temporary folder; the test starts it and stops it. No system service is used.

`synth_entry` / `synth_block` make blocks and entries without a model (the store tests need bytes,
not logits): a block's payload is derived from its chain hash, so any byte read back can be compared
with what it must be (`expected_payload`), exactly.

`redis-server` missing is an error, not a skip: CI installs it (scripts/setup.sh), and a suite that
silently skipped the shared store would prove nothing about it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def _binary(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if os.path.exists(f"/usr/bin/{name}") else None)
    if path is None:
        raise RuntimeError(f"{name} is not installed: the Redis tests need it (apt-get install redis-server; "
                           "scripts/setup.sh does this)")
    return path


def free_port(below: int = 65536) -> int:
    """A free loopback port under `below` (cluster nodes also listen on port + 10000)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < below:
            return port


class RedisServer:
    """One redis-server process on 127.0.0.1:<free port>, data in its own temp folder."""

    def __init__(self, *, port: int | None = None, maxmemory: str | None = None, folder: Path | None = None,
                 extra: tuple[str, ...] = (), persist: bool = False):
        self._auto_port = port is None  # a port taken between our probe and the server's bind: pick another
        self._below = 65536 - 10000 if "--cluster-enabled" in extra else 65536
        self.port = port or free_port(self._below)
        self._own_folder = folder is None
        self.folder = Path(folder or tempfile.mkdtemp(prefix="kvm-redis-"))
        self.maxmemory = maxmemory
        self.extra = extra
        self.persist = persist  # append-only file, fsync always: a restart after SIGKILL keeps every write
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        a = [_binary("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
             "--save", "", "--appendonly", "yes" if self.persist else "no", "--appendfsync", "always",
             "--protected-mode", "yes", "--daemonize", "no",
             "--logfile", str(self.folder / "redis.log")]
        if self.maxmemory:
            a += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
        return a + list(self.extra)

    def start(self, timeout: float = 10.0) -> "RedisServer":
        for attempt in range(5):
            self.proc = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                self.wait_ready(timeout)
                return self
            except RuntimeError:
                exited = self.proc.poll() is not None
                self.stop()  # never leave a half-started server behind
                if not self._auto_port or attempt == 4 or not exited:
                    raise
                self.port = free_port(self._below)
        return self

    def wait_ready(self, timeout: float = 10.0) -> None:
        import redis

        end = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                log = (self.folder / "redis.log")
                raise RuntimeError(f"redis-server exited: {log.read_text()[-2000:] if log.exists() else ''}")
            try:
                if redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5).ping():
                    return
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout}s")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the server abruptly (SIGKILL): what a crash or a network cut looks like to a client."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class RedisCluster:
    """A 3-primary Redis Cluster (no replicas) on free loopback ports, created with `redis-cli --cluster`."""

    def __init__(self, n: int = 3):
        self.folder = Path(tempfile.mkdtemp(prefix="kvm-cluster-"))
        self.nodes = []
        for i in range(n):
            d = self.folder / f"n{i}"
            d.mkdir()
            self.nodes.append(RedisServer(folder=d, extra=(
                "--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"),
                "--cluster-node-timeout", "2000")))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def start(self, timeout: float = 30.0) -> "RedisCluster":
        try:
            return self._start(timeout)
        except BaseException:
            self.close()  # no node outlives a failed start
            raise

    def _start(self, timeout: float) -> "RedisCluster":
        import redis

        for n in self.nodes:
            n.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        r = subprocess.run([_binary("redis-cli"), "--cluster", "create", *addrs, "--cluster-replicas", "0",
                            "--cluster-yes"], capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {r.stdout[-2000:]} {r.stderr[-2000:]}")
        end = time.monotonic() + timeout
        while True:
            infos = [redis.Redis(host="127.0.0.1", port=n.port).cluster("info") for n in self.nodes]
            if all(i.get("cluster_state") == "ok" for i in infos):
                return self
            if time.monotonic() > end:
                raise RuntimeError(f"the cluster did not become ready: {infos}")
            time.sleep(0.1)

    def close(self) -> None:
        for n in self.nodes:
            n.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "RedisCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------- synthetic store data
SYNTH_PROFILE = hashlib.sha256(b"kvmemory synthetic test profile").hexdigest()
SYNTH_C = 16
_H, _D = 2, 16  # one layer, K and V of [2, 16, 16] float32: 4096 payload bytes per block


def expected_payload(h: str, nbytes: int = 2 * _H * SYNTH_C * _D * 4) -> bytes:
    return hashlib.shake_256(bytes.fromhex(h)).digest(nbytes)


def synth_tokens(seed: int, n: int = SYNTH_C) -> tuple[int, ...]:
    d = hashlib.sha256(f"tokens {seed}".encode()).digest() * (1 + n // 16)
    return tuple(int.from_bytes(d[2 * i : 2 * i + 2], "little") % 512 for i in range(n))


def synth_block(parent: str | None, index: int, tokens):
    import torch

    from kvmemory.store.blocks import BlockMeta, chain_hash

    h = chain_hash(SYNTH_PROFILE, parent, tokens)
    data = expected_payload(h)
    meta = BlockMeta(hash=h, parent=parent, profile_id=SYNTH_PROFILE, index=index, position=index * SYNTH_C,
                     token_ids=tuple(tokens), dtype="float32", k_shapes=((_H, SYNTH_C, _D),),
                     v_shapes=((_H, SYNTH_C, _D),), payload_nbytes=len(data),
                     payload_sha256=hashlib.sha256(data).hexdigest())
    return meta, torch.frombuffer(bytearray(data), dtype=torch.uint8)


def synth_entry(seed: int, namespace: str = "default", n_blocks: int = 3, shared: int = 1):
    """An entry of `n_blocks` blocks whose first `shared` blocks are common to every synthetic entry
    (a shared system prompt), so dedup and reference counting are exercised. Returns (entry, blocks)."""
    from kvmemory.store.local import EntryRecord

    blocks, ids, parent = [], [], None
    for i in range(n_blocks):
        toks = synth_tokens(-1 - i if i < shared else seed * 1000 + i)
        meta, payload = synth_block(parent, i, toks)
        blocks.append((meta, payload))
        ids += toks
        parent = meta.hash
    ids += list(synth_tokens(seed * 7 + 3, 5))
    eid = "e" + hashlib.sha256(f"{namespace}/{seed}".encode()).hexdigest()[:15]
    att = {"attestation_id": hashlib.sha256(eid.encode()).hexdigest(), "bit_identical": True, "kl_max": 0.0}
    entry = EntryRecord(id=eid, namespace=namespace, problem=f"problem {seed}", solution=f"solution {seed}",
                        answer=str(seed), verifier={"name": "exact-answer", "ok": True}, verified=True,
                        token_ids=tuple(ids), profile_id=SYNTH_PROFILE, chain=tuple(m.hash for m, _ in blocks),
                        attestation=att, meta={"aliases": []}, created=1_700_000_000.0 + seed, updated=1_700_000_000.0 + seed)
    return entry, blocks


def check_entry_readable(store, entry_id: str) -> int:
    """Read an entry and every chain block the store offers, comparing bytes with what they must be.
    Returns the number of blocks read; raises AssertionError on any wrong byte."""
    e = store.get_entry(entry_id)
    rows = store.known_blocks(list(e.chain))
    n = 0
    for h in e.chain:
        row = rows.get(h)
        if row is None:
            break
        _, buf = store.read_block(row)
        assert bytes(buf) == expected_payload(h), f"block {h[:12]} of {entry_id} has wrong bytes"
        n += 1
    return n
