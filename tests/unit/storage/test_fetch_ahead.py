"""Reads from a store use each part as it arrives: the reader copies and verifies the first parts of
a round while the later ones are still on the wire, and a round that ends early (an error, a
checksum failure) leaves no fetching thread behind. Real S3 server (moto) behind the loopback proxy,
which only adds a latency per request so the order of arrivals is certain."""

import threading

import pytest

pytest.importorskip("obstore")

from hpdcp_runner.dcp.core.errors import CheckpointNotFoundError  # noqa: E402
from hpdcp_runner.dcp.storage.objects import object_store  # noqa: E402
from hpdcp_runner.dcp.storage.objects.object_files import StorePrefix  # noqa: E402
from tests.s3_proxy import Proxy  # noqa: E402

MiB = 1 << 20
SIZE = 12 * MiB  # three GETs of 5, 5 and 2 MiB with part_size=5MiB, one at a time


@pytest.fixture
def slow_prefix(s3_endpoint, s3_bucket):
    p = Proxy(s3_endpoint, latency_s=0.15)
    object_store.configure(object_store.ObjectStoreOptions(endpoint=p.endpoint, part_size=5 * MiB, concurrency=1))
    try:
        bucket = object_store.Bucket(f"{s3_bucket}/ck")
        blob = bytes(range(256)) * (SIZE // 256)
        bucket.put(bucket.key("blob.bin"), blob)
        files = StorePrefix(bucket, committed=False)
        direct = object_store.Bucket(f"{s3_bucket}/ck", object_store.ObjectStoreOptions(endpoint=s3_endpoint))
        yield files, direct, blob  # (``direct``: changes that do not wait in the proxy)
    finally:
        object_store.configure(object_store.ObjectStoreOptions())
        p.close()


def _getters():
    return [t for t in threading.enumerate() if t.name.startswith("hpdcp-get")]


def _fetch_and_read_first_mib(files, blob):
    """Start the round (the whole blob), read its first MiB; the handle."""
    h = files.open_handle("blob.bin", SIZE)
    files.fetch([("blob.bin", 0, SIZE)], {"blob.bin": h})
    first = bytearray(MiB)
    files.pread_into(h, 0, memoryview(first), "blob.bin")
    assert bytes(first) == blob[:MiB]
    return h


def test_the_first_part_is_read_while_the_rest_arrive(slow_prefix):
    files, _, blob = slow_prefix
    h = _fetch_and_read_first_mib(files, blob)
    assert files.bytes_arrived() == 5 * MiB  # only the first GET had landed (it used to wait for all three)
    rest = bytearray(SIZE - MiB)
    files.pread_into(h, MiB, memoryview(rest), "blob.bin")
    assert bytes(rest) == blob[MiB:] and files.bytes_arrived() == SIZE
    assert files.counters.extra["store_requests"] == 3
    files.release()
    assert not _getters()


def test_a_part_that_fails_after_others_arrived_names_the_file_and_leaves_no_thread(slow_prefix):
    files, bucket, blob = slow_prefix
    h = _fetch_and_read_first_mib(files, blob)
    bucket.delete([bucket.key("blob.bin")])  # the last GET starts only after the second one
    with pytest.raises(CheckpointNotFoundError, match="blob.bin is missing"):
        files.pread_into(h, 11 * MiB, memoryview(bytearray(MiB)), "blob.bin")
    files.release()
    assert not _getters()


def test_a_round_released_early_cancels_what_has_not_started(slow_prefix):
    files, _, _ = slow_prefix
    h = files.open_handle("blob.bin", SIZE)
    files.fetch([("blob.bin", 0, SIZE)], {"blob.bin": h})
    files.release()  # (a checksum failure in the first chunk ends the round like this)
    assert not _getters()
    assert files.bytes_arrived() <= 5 * MiB  # the running GET finished, the other two never ran
