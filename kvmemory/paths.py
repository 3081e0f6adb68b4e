"""Where kvmemory keeps things on disk by default.

The store defaults to a per-user data folder (overridable by `--store` or `KVMEMORY_STORE`); converted
models live in a per-user cache folder (overridable by `KVMEMORY_CACHE`).
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def default_store_path() -> Path:
    env = os.environ.get("KVMEMORY_STORE")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_data_dir("kvmemory")) / "store"


def cache_dir() -> Path:
    env = os.environ.get("KVMEMORY_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("kvmemory"))
