"""What a tenant learns about entries it does not own: nothing.

On a server with tenant keys (auth.py), an entry id of another tenant's namespace must be answered
exactly as an id that exists nowhere: same status, same body (apart from the id the caller sent), on
every route and MCP tool. The library's own lookup (`KVMemory.get`) is helpful instead: it says which
namespace holds an id and lists every namespace with its entry count, which is right for one user on
their own store and a leak between tenants. So the server looks entries up here:

- `private=True` (a tenant key): the entry is read in the caller's namespace only, and a miss, whether
  the id is another tenant's or nobody's, raises the one message `not_found` makes from what the caller
  sent (the id and the caller's own namespace);
- `private=False` (an admin key, or a server without keys): `KVMemory.entry`, with its helpful message.
"""

from __future__ import annotations

from kvmemory.errors import UnknownEntry
from kvmemory.memory.facade import KVMemory
from kvmemory.memory.inputs import check_entry_id
from kvmemory.store.local import EntryRecord


def not_found(entry_id: str, namespace: str) -> UnknownEntry:
    """The one answer a tenant gets for an id it cannot read: built from the request alone."""
    return UnknownEntry(f"no entry {entry_id!r} in namespace {namespace!r}")


def entry_in_scope(mem: KVMemory, namespace: str, entry_id: str, *, private: bool) -> EntryRecord:
    """The entry `entry_id` of `namespace` (module docstring for what a miss says)."""
    check_entry_id(entry_id)  # an id SQLite cannot hold is bad input (400), for everyone alike
    if not private:
        return mem.entry(entry_id, namespace)
    try:
        return mem.store.get_entry(entry_id, namespace)
    except UnknownEntry:
        raise not_found(entry_id, namespace) from None
