"""The server's metrics, rendered in Prometheus' text exposition format (version 0.0.4) at `/metrics`.

Kept here without a client library (a few counters, gauges and histograms, guarded by one lock):

- `kvmemory_requests_total{route,method,status}` and `kvmemory_request_seconds{route}` (histogram):
  every HTTP request, by route template (not the raw path, so ids never become labels);
- `kvmemory_tokens_total{kind}`: prompt tokens grafted from the store / computed, tokens decoded;
- `kvmemory_graft_hits_total`: model calls whose prompt grafted at least one stored block;
- `kvmemory_entries_routed_total`: verified entries placed before a prompt by routing;
- `kvmemory_blocks_quarantined_total`: blocks that failed their SHA-256 on read (and were recomputed);
- `kvmemory_queue_waiting`, `kvmemory_queue_running`, `kvmemory_queue_rejected_total`,
  `kvmemory_queue_wait_seconds` (histogram): the compute worker's queue (worker.py).
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _labels(pairs: Sequence[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    esc = [(k, str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')) for k, v in pairs]
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc) + "}"


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class _Histogram:
    def __init__(self, buckets: Sequence[float]):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.count += 1


class Metrics:
    """What the server counts (see the module docstring)."""

    def __init__(self, gauges: dict[str, tuple[str, Callable[[], float]]] | None = None):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str, str], int] = defaultdict(int)
        self.latency: dict[str, _Histogram] = {}
        self.tokens: dict[str, int] = {"grafted": 0, "computed": 0, "decoded": 0}
        self.graft_hits = 0
        self.model_calls = 0
        self.entries_routed = 0
        self.quarantined = 0
        self.rejected = 0
        self.queue_wait = _Histogram(LATENCY_BUCKETS)
        self.gauges = gauges or {}

    def request(self, route: str, method: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(route, method, str(status))] += 1
            self.latency.setdefault(route, _Histogram(LATENCY_BUCKETS)).observe(seconds)

    def model_call(self, *, grafted: int, computed: int, decoded: int, entries: int = 0, quarantined: int = 0) -> None:
        with self._lock:
            self.model_calls += 1
            self.tokens["grafted"] += grafted
            self.tokens["computed"] += computed
            self.tokens["decoded"] += decoded
            self.graft_hits += int(grafted > 0)
            self.entries_routed += entries
            self.quarantined += quarantined

    def queue_rejected(self) -> None:
        with self._lock:
            self.rejected += 1

    def waited(self, seconds: float) -> None:
        with self._lock:
            self.queue_wait.observe(seconds)

    def render(self) -> str:
        out: list[str] = []

        def family(name: str, kind: str, help_: str) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")

        def hist(name: str, h: _Histogram, labels: Sequence[tuple[str, str]] = ()) -> None:
            for b, c in zip(h.buckets, h.counts):
                out.append(f"{name}_bucket{_labels([*labels, ('le', _num(b))])} {c}")
            out.append(f"{name}_bucket{_labels([*labels, ('le', '+Inf')])} {h.count}")
            out.append(f"{name}_sum{_labels(labels)} {_num(h.sum)}")
            out.append(f"{name}_count{_labels(labels)} {h.count}")

        with self._lock:
            family("kvmemory_requests_total", "counter", "HTTP requests by route template, method and status.")
            for (route, method, status), n in sorted(self.requests.items()):
                out.append(f"kvmemory_requests_total{_labels([('route', route), ('method', method), ('status', status)])} {n}")
            family("kvmemory_request_seconds", "histogram", "HTTP request latency by route template.")
            for route, h in sorted(self.latency.items()):
                hist("kvmemory_request_seconds", h, [("route", route)])
            family("kvmemory_tokens_total", "counter",
                   "Prompt tokens grafted from the store or computed, and tokens decoded.")
            for kind, n in self.tokens.items():
                out.append(f"kvmemory_tokens_total{_labels([('kind', kind)])} {n}")
            family("kvmemory_model_calls_total", "counter", "Requests that ran the model.")
            out.append(f"kvmemory_model_calls_total {self.model_calls}")
            family("kvmemory_graft_hits_total", "counter", "Model calls whose prompt grafted at least one stored block.")
            out.append(f"kvmemory_graft_hits_total {self.graft_hits}")
            family("kvmemory_entries_routed_total", "counter", "Verified entries placed before a prompt by routing.")
            out.append(f"kvmemory_entries_routed_total {self.entries_routed}")
            family("kvmemory_blocks_quarantined_total", "counter",
                   "Stored blocks that failed their SHA-256 check on read (quarantined and recomputed).")
            out.append(f"kvmemory_blocks_quarantined_total {self.quarantined}")
            family("kvmemory_queue_rejected_total", "counter", "Requests refused with 429: the queue was full.")
            out.append(f"kvmemory_queue_rejected_total {self.rejected}")
            family("kvmemory_queue_wait_seconds", "histogram", "Time requests waited for the compute worker.")
            hist("kvmemory_queue_wait_seconds", self.queue_wait)
            for name, (help_, fn) in sorted(self.gauges.items()):
                family(name, "gauge", help_)
                out.append(f"{name} {_num(fn())}")
        return "\n".join(out) + "\n"
