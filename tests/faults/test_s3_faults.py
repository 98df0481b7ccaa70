"""Object-store faults: a loopback proxy in front of the real S3 server, and of azurite (Azure Blob),
(tests/s3_proxy.py) injects throttling (503 SlowDown), server errors, dropped connections and
refusals; the retry and throttling tests run on both stores. Bounded retries with
backoff absorb transient ones; past them, or for a refusal, one error naming the bucket or key, no
credentials in it, nothing published and the previous checkpoint intact.

moto's server does not check signatures unless IAM is set up, so wrong credentials and missing
permissions are the proxy answering what S3 answers (403 InvalidAccessKeyId / AccessDenied)."""

import pytest
import torch

from hpdcp_runner import dcp
from hpdcp_runner.dcp.storage.objects import object_store
from tests import s3_server
from tests.s3_proxy import Proxy


def _sd(v):
    return {"w": torch.full((300, 1000), float(v)), "step": int(v)}


def _loads_as(path, v):
    got = {"w": torch.zeros(300, 1000), "step": -1}
    dcp.load(got, checkpoint_id=path)
    return got["step"] == v and torch.equal(got["w"], _sd(v)["w"])


def _no_secret(e):
    assert s3_server.CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in str(e)
    assert len(str(e).splitlines()) == 1, str(e)


def test_throttling_and_server_errors_are_retried(proxied_store):
    p, bucket = proxied_store
    path = f"{bucket}/ck"
    p.fail_next(2, 503, "SlowDown", method="PUT")
    dcp.save(_sd(1), checkpoint_id=path)
    p.fail_next(2, 500, "InternalError", method="GET")
    assert _loads_as(path, 1)
    assert p.faults_served == 4


def test_persistent_throttling_is_one_clear_error_and_publishes_nothing(proxied_store):
    p, bucket = proxied_store
    path = f"{bucket}/ck"
    dcp.save(_sd(1), checkpoint_id=path)
    p.fail_next(50, 503, "SlowDown", method="PUT")
    with pytest.raises(dcp.StorageAccessError) as ei:
        dcp.save(_sd(2), checkpoint_id=path, overwrite=True)
    assert f"{bucket.split('://', 1)[1]}/ck" in str(ei.value) and "503" in str(ei.value)
    _no_secret(ei.value)
    p.fail_next(0)
    assert _loads_as(path, 1)  # the previous checkpoint is intact


def test_dropped_connections_mid_upload(proxied_store):
    p, bucket = proxied_store
    path = f"{bucket}/ck"
    p.drop_next(2, method="PUT")
    dcp.save(_sd(1), checkpoint_id=path)  # retried
    assert _loads_as(path, 1)
    p.drop_next(50, method="PUT")
    with pytest.raises(dcp.StorageAccessError) as ei:
        dcp.save(_sd(2), checkpoint_id=path, overwrite=True)
    _no_secret(ei.value)
    p.drop_next(0)
    assert _loads_as(path, 1)


@pytest.mark.parametrize("code", ["InvalidAccessKeyId", "AccessDenied", "SignatureDoesNotMatch"])
def test_refusals_name_the_key_and_say_check_credentials(proxied, code):
    p, bucket = proxied
    p.fail_next(50, 403, code)
    with pytest.raises(dcp.StorageAccessError, match=f"refused \\({code}; check the credentials in the environment \\(AWS_ACCESS_KEY_ID") as ei:
        dcp.save(_sd(1), checkpoint_id=f"{bucket}/ck")
    assert f"{bucket}/ck" in str(ei.value)
    _no_secret(ei.value)
    p.fail_next(50, 403, code)
    with pytest.raises(dcp.StorageAccessError, match="refused"):
        dcp.load({"w": torch.zeros(1)}, checkpoint_id=f"{bucket}/ck")
    p.fail_next(0)


def test_missing_client_library_is_one_line(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_obstore(name, *a, **k):
        if name.startswith("obstore"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_obstore)
    monkeypatch.setattr(object_store, "_STORES", {})
    with pytest.raises(dcp.ConfigError, match=r'pip install "hpdcp_runner\[s3\]"'):
        dcp.save({"w": torch.zeros(1)}, checkpoint_id="s3://some-bucket/ck")


def test_credentials_from_a_profile_file(s3_endpoint, s3_bucket, tmp_path, monkeypatch):
    """No keys in the environment, a profile in AWS's shared credentials file: the requests are
    signed with that profile's key (seen by the proxy), and the key never shows in an error."""
    pytest.importorskip("boto3")
    creds = tmp_path / "credentials"
    creds.write_text("[ckpt]\naws_access_key_id = PROFILEKEYID123\n"
                     f"aws_secret_access_key = {s3_server.CREDENTIALS['AWS_SECRET_ACCESS_KEY']}\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_PROFILE", "ckpt")
    p = Proxy(s3_endpoint)
    object_store.configure(object_store.ObjectStoreOptions(endpoint=p.endpoint))
    monkeypatch.setattr(object_store, "_STORES", {})
    try:
        dcp.save(_sd(1), checkpoint_id=f"{s3_bucket}/ck")
        assert "Credential=PROFILEKEYID123/" in p.last_authorization
        assert _loads_as(f"{s3_bucket}/ck", 1)
    finally:
        object_store.configure(object_store.ObjectStoreOptions())
        p.close()
