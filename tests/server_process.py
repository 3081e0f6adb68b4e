"""A real `kvmemory serve` process for the server tests: started on a free port with a throw-away
store, waited for on /healthz, stopped with SIGTERM (graceful shutdown) at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvmemory.bench.serve import free_port  # noqa: F401  (one free-port helper, the bench's)

START_TIMEOUT_S = 300  # the model loads in ~20 s on 2 cores; a cold conversion cache takes longer


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    store: Path
    log: Path
    keys: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str | None = None, timeout: float = 300.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def log_lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines() if self.log.exists() else []

    def stop(self, timeout: float = 120.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode


def start_server(tmp: Path, *args: str, keys: dict[str, str] | None = None, keys_file: dict | None = None) -> ServerProcess:
    """`kvmemory serve` in a subprocess on a free port over a fresh store in `tmp`; returns once
    /healthz answers. `keys`: name -> key of the admin keys (--api-key); `keys_file`: a keys file's JSON."""
    tmp.mkdir(parents=True, exist_ok=True)
    store, log = tmp / "store", tmp / "server.log"
    port = free_port()
    cmd = [sys.executable, "-m", "kvmemory.cli", "serve", "--store", str(store), "--port", str(port), *args]
    for key in (keys or {}).values():
        cmd += ["--api-key", key]
    if keys_file is not None:
        path = tmp / "keys.json"
        path.write_text(json.dumps(keys_file))
        cmd += ["--keys-file", str(path)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "utf-8"}
    env.pop("KVMEMORY_API_KEY", None)
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
    server = ServerProcess(proc, port, store, log, dict(keys or {}))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvmemory serve exited {proc.returncode}:\n" + "\n".join(server.log_lines()[-40:]))
        try:
            if httpx.get(f"{server.url}/healthz", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError("kvmemory serve did not answer /healthz in time:\n" + "\n".join(server.log_lines()[-40:]))
