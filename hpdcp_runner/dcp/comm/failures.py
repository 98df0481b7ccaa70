"""What a failed collective means, in one line: a peer whose connection closed (its process is
gone) told apart from one that is slow or elsewhere. Shared by the control-plane collectives and
the replica broadcasts; imports nothing of theirs."""

from __future__ import annotations

from ..core import errors as errmod
from ..core.errors import CollectiveTimeoutError
from ..core.utils import get_logger

log = get_logger(__name__)

#: what gloo (and the TCP store) say when the other end of a connection went away
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed",
              "read error", "end of file")


def collective_error(phase: str, rank: int, world_size: int, e: BaseException) -> CollectiveTimeoutError:
    """One line for a failed collective: a peer whose connection closed (its process is gone)
    apart from one that is slow or elsewhere; the backend's multi-line text (a C++ trace) is cut
    to its first line and kept whole in the rank's log."""
    text = str(e).strip()
    log.debug("collective during %r failed on rank %d: %s", phase, rank, text)
    first = (text.splitlines() or [type(e).__name__])[0][:300]
    if any(p in text.lower() for p in _PEER_GONE):
        return errmod.PeerLostError(
            f"during '{phase}' a peer rank's connection closed (rank {rank} of {world_size} saw it: {first}): that "
            f"rank's process is gone (killed, out of memory or crashed); its own log says why")
    return CollectiveTimeoutError(
        f"collective during '{phase}' failed on rank {rank} of {world_size}: {first}. A peer rank probably died, hung "
        f"or took a different code path (raise the timeout if it is just slow)")
