"""Checksums of the format: XXH3-64 of bytes, per-block digests, and a file's checksum.

Kept apart from the safetensors I/O so the chunk index (which stores digests as integers) and the
rank files share one definition without importing each other.
"""

from __future__ import annotations

from typing import Iterable

import xxhash


def digest(data: memoryview | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def digest_pieces(pieces: Iterable[bytes]) -> str:
    """``digest`` of the concatenation of ``pieces``, streamed (a multi-GiB index entry)."""
    h = xxhash.xxh3_64()
    for p in pieces:
        h.update(p)
    return h.hexdigest()


BLOCK_BYTES = 1 << 20  # chunks larger than this also get one checksum per block (verified partial reads)


def block_digests(view: memoryview, block: int = BLOCK_BYTES) -> str:
    """Concatenated 16-hex-digit digests of each ``block`` bytes of ``view`` ('' for one block or
    less: the chunk's own checksum covers it)."""
    n = len(view)
    if n <= block:
        return ""
    return "".join(xxhash.xxh3_64_hexdigest(view[i:i + block]) for i in range(0, n, block))


def file_checksum(header: bytes, entry_digests: Iterable[str]) -> str:
    """A file's checksum: the hash of its header and of its entries' digests, in file order.

    Hashing digests instead of the bytes again halves the hashing work of a save; ``verify``
    recomputes every entry digest from the bytes, so it is just as strong.
    """
    h = xxhash.xxh3_64(header)
    for d in entry_digests:
        h.update(d.encode("ascii"))
    return h.hexdigest()
