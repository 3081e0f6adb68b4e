"""bench/page_cache.py: `warm` puts a file's pages in the page cache and `drop` takes them out, as the
kernel itself reports (mincore on a mapping of the file); `reclaimer` reads the machine's DAMON setup."""

import ctypes
import mmap
import os

import pytest

from kvmemory.bench import page_cache

_libc = ctypes.CDLL(None, use_errno=True)


def resident_fraction(path) -> float:
    """The fraction of `path`'s pages held in the page cache (mincore over a private mapping, untouched)."""
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as fh:
        m = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)  # writable, so ctypes can take its address
        try:
            anchor = ctypes.c_char.from_buffer(m)
            rc = _libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
            del anchor
        finally:
            m.close()
    if rc != 0:
        pytest.skip(f"mincore failed here: errno {ctypes.get_errno()}")
    return sum(v & 1 for v in vec) / pages


def test_warm_and_drop_move_a_file_in_and_out_of_the_page_cache(tmp_path):
    files = [tmp_path / f"block{i}" for i in range(3)]
    for f in files:
        f.write_bytes(os.urandom(3 << 20))  # dirty pages: drop writes them back before evicting
    page_cache.drop(files)
    assert max(resident_fraction(f) for f in files) < 0.05
    assert page_cache.warm(files) == 3 * (3 << 20)
    assert min(resident_fraction(f) for f in files) == 1.0
    page_cache.drop(files[:1])
    assert resident_fraction(files[0]) < 0.05 and resident_fraction(files[1]) == 1.0
    assert page_cache.warm([]) == 0


def test_reclaimer_reads_damon_schemes(tmp_path, monkeypatch):
    ctx = tmp_path / "0" / "contexts" / "0"
    scheme = ctx / "schemes" / "0"
    (scheme / "access_pattern" / "age").mkdir(parents=True)
    (ctx / "monitoring_attrs" / "intervals").mkdir(parents=True)
    (tmp_path / "0" / "state").write_text("on\n")
    (scheme / "action").write_text("pageout\n")
    (scheme / "access_pattern" / "age" / "min").write_text("12\n")
    (ctx / "monitoring_attrs" / "intervals" / "aggr_us").write_text("5000000\n")
    monkeypatch.setattr(page_cache, "_DAMON", tmp_path)
    assert page_cache.reclaimer() == "DAMON pageout of pages idle >= 60 s"
    (tmp_path / "0" / "state").write_text("off\n")
    assert page_cache.reclaimer() is None
    monkeypatch.setattr(page_cache, "_DAMON", tmp_path / "missing")
    assert page_cache.reclaimer() is None
