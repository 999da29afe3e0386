"""Bad locations, modes, options, credentials and endpoints give clear vcdask errors."""

from __future__ import annotations

import time

import pytest
import torch

from vcdask import open_store
from vcdask.errors import (
    InvalidLocationError,
    StoreAccessDeniedError,
    StoreExistsError,
    StoreNotFoundError,
    StoreUnreachableError,
    VcdaskError,
    VersionNotFoundError,
)
from vcdask.testing.s3 import free_port, moto_server


def test_unknown_scheme_lists_supported():
    with pytest.raises(
        InvalidLocationError, match=r"'ftp'.*supported schemes: \['abfs', 'az', 'file', 'gcs', 'gs', 'memory', 's3'\]"
    ):
        open_store("ftp://host/path")


def test_bad_mode_lists_modes(tmp_path):
    with pytest.raises(ValueError, match=r"invalid mode 'x'.*\['r', 'r\+', 'a', 'w-'\]"):
        open_store(tmp_path, mode="x")


def test_bad_location_type():
    with pytest.raises(TypeError, match="unsupported store location type int"):
        open_store(42)


def test_empty_location():
    with pytest.raises(InvalidLocationError, match="empty store location"):
        open_store("")


def test_unknown_s3_option_lists_valid():
    with pytest.raises(InvalidLocationError, match=r"unknown storage option\(s\) \['endpoint_ur'\].*endpoint_url"):
        open_store("s3://bucket/prefix", endpoint_ur="http://127.0.0.1:1")


def test_options_for_local_store_rejected(tmp_path):
    with pytest.raises(InvalidLocationError, match=r"\['endpoint_url'\].*local"):
        open_store(tmp_path / "s", endpoint_url="http://x")


def test_s3_location_without_bucket():
    with pytest.raises(InvalidLocationError, match="names no bucket"):
        open_store("s3:///prefix")


def test_azure_needs_account():
    with pytest.raises(InvalidLocationError, match="account="):
        open_store("az://container/prefix")


def test_directory_that_is_not_a_store(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(StoreNotFoundError, match=str(tmp_path)) as info:
        open_store(tmp_path)
    assert "not a vcdask store" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert (tmp_path / "notes.txt").read_text() == "hello"


def test_file_that_is_not_a_store(tmp_path):
    path = tmp_path / "weights.pt"
    path.write_bytes(b"x")
    with pytest.raises(StoreNotFoundError, match="weights.pt"):
        open_store(path)


def test_read_mode_needs_existing_store(tmp_path):
    with pytest.raises(StoreNotFoundError, match="missing.*mode='r'"):
        open_store(tmp_path / "missing", mode="r")
    assert not (tmp_path / "missing").exists()


def test_create_exclusive(tmp_path):
    open_store(tmp_path / "s", mode="w-")
    with pytest.raises(StoreExistsError, match="already holds a store"):
        open_store(tmp_path / "s", mode="w-")
    assert open_store(tmp_path / "s", mode="r+").versions() == []


def test_unknown_version_is_keyerror_naming_it(tmp_path):
    store = open_store(tmp_path / "s")
    store.commit({"w": torch.zeros(3)})
    with pytest.raises(KeyError, match="ZZZZZZZZZZZZZZZZZZZZ") as info:
        store.read("ZZZZZZZZZZZZZZZZZZZZ")
    assert isinstance(info.value, VersionNotFoundError)
    assert str(info.value).startswith("no version 'ZZZZZZZZZZZZZZZZZZZZ'")  # no KeyError quoting


def test_version_and_tag_together(tmp_path):
    store = open_store(tmp_path / "s")
    with pytest.raises(ValueError, match="not both"):
        store.read("abc", tag="t")


@pytest.mark.s3
def test_missing_bucket(s3):
    with pytest.raises(StoreNotFoundError, match="no-such-bucket") as info:
        open_store("s3://no-such-bucket/runs", **s3.options())
    assert "does not exist" in str(info.value)
    assert s3.endpoint_url in str(info.value)


@pytest.mark.s3
def test_s3_path_that_is_not_a_store_in_read_mode(s3):
    bucket = s3.new_bucket()
    with pytest.raises(StoreNotFoundError, match=f"s3://{bucket}/nothing-here"):
        open_store(f"s3://{bucket}/nothing-here", mode="r", **s3.options())


@pytest.mark.s3
def test_credentials_from_environment(s3):
    """No credentials in the options: the standard chain (here, environment variables) is used."""
    bucket = s3.new_bucket()
    store = open_store(f"s3://{bucket}/env", endpoint_url=s3.endpoint_url)
    v = store.commit({"w": torch.ones(4)})
    assert store.read(v).state_dict()["w"].sum().item() == 4


@pytest.mark.s3
def test_s3fs_style_options(s3):
    bucket = s3.new_bucket()
    store = open_store(
        f"s3://{bucket}/x",
        key="testing",
        secret="testing",
        client_kwargs={"endpoint_url": s3.endpoint_url, "region_name": "us-east-1"},
    )
    assert store.read(store.commit({"w": torch.ones(2)})).metadata == {}


@pytest.mark.s3
@pytest.mark.slow
def test_bad_credentials():
    with moto_server(auth=True) as server:
        with pytest.raises(StoreAccessDeniedError, match="s3://some-bucket/runs") as info:
            open_store("s3://some-bucket/runs", **server.options(access_key_id="AKIAWRONGKEY"))
    assert "InvalidAccessKeyId" in str(info.value)
    assert isinstance(info.value, PermissionError)


@pytest.mark.s3
def test_unreachable_endpoint():
    endpoint = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(StoreUnreachableError, match=endpoint.replace(".", r"\.")) as info:
        open_store("s3://bucket/runs", endpoint_url=endpoint, access_key_id="a", secret_access_key="b", max_tries=1)
    assert isinstance(info.value, ConnectionError)
    assert isinstance(info.value, VcdaskError)
    assert "Connection refused" in str(info.value)
    assert time.monotonic() - start < 60
