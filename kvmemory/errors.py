"""Typed errors of kvmemory.

Every error a user can meet is one of these, with a message that says what happened and what to do.
Bad input never reaches the model and never corrupts the store: these are raised before either.
"""

from __future__ import annotations


class KVMemoryError(Exception):
    """Base class of every kvmemory error."""


class InvalidInput(KVMemoryError, ValueError):
    """Text or token ids that cannot be used (empty, over-long, out of vocabulary)."""


class DeviceUnavailable(InvalidInput):
    """A device that was asked for by name (`cuda`, `cuda:N`) and is not here: a CPU build of torch, no
    visible GPU, an index past the last one. Raised before any model loads; never replaced by another."""


class ProfileMismatch(KVMemoryError):
    """Blocks or an entry made under another execution profile; `fields` names what differs."""

    def __init__(self, message: str, fields: dict[str, tuple[object, object]] | None = None):
        super().__init__(message)
        self.fields = fields or {}


class NotOnGrid(KVMemoryError):
    """A graft point or block that is not on the chunk grid, or a block placed off its own position."""


class IntegrityError(KVMemoryError):
    """Stored bytes whose SHA-256 (or structure) does not match what the catalogue recorded."""


class BundleError(IntegrityError):
    """A bundle file (`kvmemory export` / `import`) that is damaged, incomplete or not a kvmemory bundle;
    it is refused whole, before anything of it is written."""


class UnsupportedArchitecture(KVMemoryError):
    """A model whose cache cannot be grafted exactly (refused rather than grafted approximately)."""


class StoreError(KVMemoryError):
    """Base class of store failures."""


class StoreFormatError(StoreError):
    """A store written by a newer kvmemory format, or a folder that is not a kvmemory store."""


class StoreReadOnly(StoreError):
    """A write was asked of a store that can only be read."""


class StoreFull(StoreError):
    """The disk (or the store's size budget) has no room; nothing was written."""


class UnsupportedModel(InvalidInput):
    """A model file kvmemory cannot compute exactly (an architecture or a GGUF block type it lacks): refused
    by name before anything loads."""


class UnknownModel(KVMemoryError, OSError):
    """A model that is neither the embedded one, a local folder, nor in the local Hugging Face cache
    (kvmemory downloads nothing at run time). An OSError too: transformers raised one before."""


class UnknownEntry(KVMemoryError, KeyError):
    """No entry with this id (in this namespace)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown entry"


class VerificationFailed(KVMemoryError):
    """A solution refused by its verifier, or a graft whose logits differ from the recompute."""


class RouterMismatch(KVMemoryError):
    """A router index built with another embedder; run `kvmemory reindex`."""


class GraphCaptureError(KVMemoryError):
    """A static step that could not be captured in a CUDA graph (engine/static_step.py); open with
    step='static' (the same shapes, run eagerly) or step='dynamic'."""


class RepairRefused(StoreError):
    """`fsck --repair` would take most of a store out of service (wrong signing key, wrong profile, a
    different store): it changes nothing and says why; `--force` repairs anyway."""


class CatalogueLost(StoreError):
    """A store whose catalogue is missing, empty or damaged while its entry records and blocks are
    there: nothing is served from it (it is not an empty store); `kvmemory fsck --repair` rebuilds
    the catalogue from the records and blocks."""
