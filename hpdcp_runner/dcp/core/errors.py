"""One exception hierarchy for the engine.

Every subclass also derives from the matching builtin, so callers that already catch
``FileNotFoundError`` or ``ValueError`` keep working, while ``except HpdcpError`` catches all.
"""

from __future__ import annotations

from typing import Mapping


class HpdcpError(Exception):
    """Base class of every error raised on purpose by hpdcp_runner."""


class ConfigError(HpdcpError, ValueError):
    """A configuration value (runner config or engine argument) is invalid."""


class CheckpointNotFoundError(HpdcpError, FileNotFoundError):
    """The checkpoint directory, its metadata or one of its files does not exist."""


class CheckpointExistsError(HpdcpError, FileExistsError):
    """The save target already exists and ``overwrite`` was not given."""


class StorageAccessError(HpdcpError, OSError):
    """The storage refused an operation: permission denied, read-only file system, a file where a
    directory should be, no space left. Bad input or environment, not a failed peer."""


class CheckpointChangedError(HpdcpError, OSError):
    """The checkpoint being loaded was replaced or deleted by another process during the load."""


class CommitDurabilityError(HpdcpError, OSError):
    """The checkpoint was committed (complete, loadable under its name) but making the commit
    durable failed (fsync of its directory): it may not survive a machine crash."""


class MetadataError(HpdcpError, ValueError):
    """``metadata.json`` is malformed, too large, inconsistent or of an unknown version."""


class CorruptCheckpointError(HpdcpError, OSError):
    """A checkpoint file is truncated, has a bad header or fails its checksum."""


class StateDictError(HpdcpError, ValueError):
    """The state dict given to save/load is unusable (bad leaf, duplicate key, bad layout)."""


class KeyMismatchError(StateDictError):
    """Strict load found missing and/or unexpected keys."""

    wire_attrs = ("missing", "unexpected")  # carried when the error is agreed across ranks

    def __init__(self, message: str, missing: list[str] = (), unexpected: list[str] = ()) -> None:
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)


class ShapeMismatchError(StateDictError):
    """A key's shape or dtype differs between the checkpoint and the target, or across ranks."""


class CoverageError(StateDictError):
    """Part of a tensor is covered by no saved chunk (or, on save, by overlapping chunks)."""


class PickleNotAllowedError(HpdcpError, PermissionError):
    """An object needs pickle but ``allow_pickle`` was not given: nothing was unpickled."""


class ReplicaMismatchError(StateDictError):
    """Ranks holding the same replicated chunk hold different values (opt-in check)."""


class InsufficientMemoryError(HpdcpError, RuntimeError):
    """What a checkpoint asks this rank to allocate exceeds what the device has available."""


class DistributedError(HpdcpError, RuntimeError):
    """One or more ranks failed; raised identically on every rank.

    ``failures`` maps rank -> the message that rank reported.
    """

    def __init__(self, phase: str, failures: Mapping[int, str]) -> None:
        self.phase = phase
        self.failures = dict(sorted(failures.items()))
        lines = "; ".join(f"rank {r}: {m}" for r, m in self.failures.items())
        super().__init__(f"{phase} failed on {len(self.failures)} rank(s): {lines}")


class PersistProcessError(HpdcpError, RuntimeError):
    """A rank's persisting process (``async_save(mode="process")``) died or could not start;
    nothing of that save was published."""


class CollectiveTimeoutError(HpdcpError, TimeoutError):
    """A collective did not complete in time: a rank is dead, hung or diverged."""


class PeerLostError(CollectiveTimeoutError):
    """A collective failed because a peer rank's connection closed: that process is gone
    (killed, out of memory, crashed), not slow; its own log says why."""
