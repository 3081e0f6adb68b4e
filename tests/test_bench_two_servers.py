"""`kvmemory bench serve --two-servers N` (bench/two_servers.py): two real `kvmemory serve` processes on a
real redis-server; what one remembers the other routes, what one forgets the other drops, and the report
says how soon (timings are the bench's to judge, not this test's)."""

from __future__ import annotations

import pytest

from kvmemory.bench.two_servers import format_line, run_two_servers

pytestmark = pytest.mark.slow


def test_two_servers_on_one_redis_store_see_each_others_changes():
    r = run_two_servers(entries=2)
    assert r["ran"] and r["not_seen"] == 0 and r["not_dropped"] == 0
    assert r["visible_s"]["n"] == 2 and r["dropped_s"]["n"] == 2 and r["recall_s"]["n"] >= 4
    assert "routed by B after" in format_line(r)
