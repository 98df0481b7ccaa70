"""How a transfer is cut into parts on a store: enough parts to keep every connection busy (a store
serves each connection at a bounded rate), never over part_size, never under the floor."""

import pytest

pytest.importorskip("obstore")

from hpdcp_runner.dcp.storage.objects.object_store import Bucket, ObjectStoreOptions  # noqa: E402
from hpdcp_runner.dcp.storage.store_client import MIN_UPLOAD_PART  # noqa: E402

MiB = 1 << 20


@pytest.mark.parametrize("nbytes,floor,want", [
    (64 * MiB, MIN_UPLOAD_PART, 8 * MiB),     # 16 MiB parts would use 4 of 8 connections
    (1024 * MiB, MIN_UPLOAD_PART, 16 * MiB),  # large: part_size
    (12 * MiB, MIN_UPLOAD_PART, 5 * MiB),     # an upload's parts never under S3's 5 MiB
    (4 * MiB, 1 * MiB, 1 * MiB),              # a read's pieces: down to its own floor
    (None, MIN_UPLOAD_PART, 16 * MiB),        # size unknown: part_size
])
def test_parts_keep_every_connection_busy(nbytes, floor, want):
    b = Bucket("s3://bucket/ck", ObjectStoreOptions(part_size=16 * MiB, concurrency=8))
    assert b.part_for(nbytes, floor) == want


def test_a_small_part_size_is_kept():
    b = Bucket("s3://bucket/ck", ObjectStoreOptions(part_size=5 * MiB, concurrency=2))
    assert b.part_for(1024 * MiB) == 5 * MiB
