"""Where blocks and entries live: the block format, the local store (files + SQLite), the Redis store,
signing, fsck, and `open_store` (one string: a folder or a redis:// URL)."""
