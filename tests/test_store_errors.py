"""Bad locations, modes, options, credentials and endpoints give clear vcdask errors."""

from __future__ import annotations

import math
import re
import time
import traceback
import uuid

import dask.config
import pytest
import torch

from vcdask import open_store
from vcdask.errors import (
    InvalidLocationError,
    MissingRegionError,
    StoreAccessDeniedError,
    StoreError,
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


def test_a_version_that_is_not_an_id_is_a_typeerror_naming_it(tmp_path):
    """What a history row of a merge committed with later ones holds (NaN, as pandas has an empty
    version_id), or any other non-str, is refused by name wherever a version is taken (read, load, tag,
    create_branch, read_state, version_nbytes, hold), before Icechunk sees it (it said "argument
    'snapshot_id': 'float' object cannot be cast as 'str'")."""
    import vcdask

    store = open_store(tmp_path / "s")
    store.commit({"w": torch.zeros(3)})
    with pytest.raises(
        TypeError, match=r"version must be a version id .* got nan \(float\): a history row whose merge"
    ):
        store.read(float("nan"))
    with pytest.raises(TypeError, match=r"got nan \(float\)"):
        vcdask.load(store, torch.nn.Linear(3, 1), version=float("nan"))
    with pytest.raises(TypeError, match=r"got 3 \(int\)$"):
        store.tag("t", 3)
    with pytest.raises(TypeError, match=r"got None \(NoneType\)$"):
        store.tag("t", None)
    with pytest.raises(TypeError, match=r"got b'abc' \(bytes\)$"):
        store.create_branch("b", b"abc")
    for take in (store.read_state, store.version_nbytes):
        with pytest.raises(TypeError, match=r"got nan \(float\)"):
            take(float("nan"))
    with pytest.raises(TypeError, match=r"got nan \(float\)"), store.hold(float("nan")):
        pass
    assert store.tags() == {} and "b" not in store.branches()


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
    assert (info.value.missing, info.value.location) == ("bucket", None)  # what the CLI and jobs say


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
@pytest.mark.parametrize("max_tries", [1, 3])
@pytest.mark.parametrize("opened_by", ["creating", "opening"])
def test_max_tries_bounds_each_request_to_a_failing_s3(s3, max_tries, opened_by):
    """Against an S3 that answers every request 503, a look-up and a commit each fail after ``max_tries``
    requests, in seconds, whether the store was created or opened by that call. (Icechunk keeps the client
    that the store's first request built: before vcdask opened its repository on a fresh copy of it, the
    defaults applied, 10 requests and 19-50 s for one look-up, whatever ``max_tries`` said.)"""
    from vcdask.errors import StoreError
    from vcdask.testing.faulty_proxy import FaultyProxy

    location = f"s3://{s3.new_bucket()}/runs"
    with FaultyProxy(s3.endpoint_url, seed=1) as proxy:
        options = {"endpoint_url": proxy.endpoint_url, "access_key_id": "testing", "secret_access_key": "testing"}
        if opened_by == "opening":
            open_store(location, **options).commit({"w": torch.ones(2)})
        store = open_store(location, max_tries=max_tries, **options)
        store.commit({"w": torch.zeros(2)})
        proxy.set_faults(p_503=1.0)
        for what, attempt in [
            ("look-up", lambda: store.head("main")),
            ("commit", lambda: store.commit({"w": torch.ones(2)})),
        ]:
            before, start = proxy.faults.counts["503"], time.monotonic()
            with pytest.raises(StoreError, match="SlowDown"):
                attempt()
            assert (what, proxy.faults.counts["503"] - before) == (what, max_tries)
            assert time.monotonic() - start < 10, what


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


def _no_region(monkeypatch, tmp_path, s3) -> None:
    """An environment with no region anywhere: the SDK's own endpoint setting (so no endpoint_url option, for
    which vcdask would default the region), no AWS_REGION, no profile, instance metadata on a closed loopback port."""
    for var in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "ICECHUNK_LOG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{free_port()}")


_OPEN_WITHOUT_REGION = (
    "import sys\n"
    "from vcdask import open_store\n"
    "try:\n"
    "    open_store(sys.argv[1], mode='a', allow_http=True, force_path_style=True)\n"
    "except Exception as e:\n"
    "    print(type(e).__name__, e)\n"
)


@pytest.mark.s3
def test_bucket_without_region_is_named_with_the_remedy(s3, monkeypatch, tmp_path):
    _no_region(monkeypatch, tmp_path, s3)
    bucket = s3.new_bucket()
    with pytest.raises(InvalidLocationError) as info:
        open_store(f"s3://{bucket}/runs", mode="a", allow_http=True, force_path_style=True)
    message = str(info.value)
    assert f"s3://{bucket}/runs" in message
    assert "no region is set for the bucket" in message  # the cause, not "endpoint could not be reached"
    assert "region='eu-west-1'" in message and "storage_options={'region'" in message and "AWS_REGION" in message
    assert "could not be reached" not in message
    assert isinstance(info.value, MissingRegionError) and isinstance(info.value, ValueError)
    assert info.value.what == f"opening 's3://{bucket}/runs'"
    assert info.value.cause and "region" in info.value.cause


@pytest.mark.s3
def test_missing_region_names_the_cli_flag_and_the_job_field(s3, monkeypatch, tmp_path, capsys):
    """Each front end gives its own remedy: ``--region REGION`` on the command line, the field in a job file."""
    from vcdask.cli import main
    from vcdask.jobs import JobFileError, load_job, preflight

    _no_region(monkeypatch, tmp_path, s3)
    location = f"s3://{s3.new_bucket()}/runs"
    code = main(["runs", location, "-o", "allow_http=true", "-o", "force_path_style=true"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("vcdask runs: opening ") and "no region is set for the bucket" in err
    assert "--region REGION" in err and "open_store(" not in err and "region=" not in err

    (tmp_path / "models.py").write_text("import torch\ndef make():\n    return torch.nn.Linear(2, 2)\n")
    (tmp_path / "train.csv").write_text("a,b,y\n1,2,0\n3,4,1\n")
    job = tmp_path / "job.yaml"
    job.write_text(
        f"model: models:make\ndata: {{path: train.csv, label: y}}\n"
        f"store: {{location: '{location}', storage_options: {{allow_http: true, force_path_style: true}}}}\n"
    )
    with pytest.raises(JobFileError) as info:
        preflight(load_job(job))
    assert info.value.field == "store.storage_options.region"
    assert "no region is set for the bucket" in str(info.value) and "region: eu-west-1" in str(info.value)
    assert "open_store(" not in str(info.value)


def test_a_missing_store_says_where_and_in_which_mode(tmp_path):
    """The CLI and jobs build their messages from these attributes; Python users keep the mode= remedy."""
    for mode in ("r", "r+"):
        with pytest.raises(StoreNotFoundError) as info:
            open_store(tmp_path / "nope", mode=mode)
        where = f"local directory {str(tmp_path / 'nope')!r}"
        assert (info.value.location, info.value.mode, info.value.missing) == (where, mode, "store")
        assert "use mode='a' to create one" in str(info.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreNotFoundError) as info:
        open_store(tmp_path / "file", mode="r")
    assert info.value.location is None and info.value.missing is None and "is a file, not" in str(info.value)


@pytest.mark.s3
def test_bucket_without_region_keeps_the_rust_log_noise_out_of_the_terminal(s3, monkeypatch, tmp_path):
    import subprocess
    import sys

    _no_region(monkeypatch, tmp_path, s3)
    location = f"s3://{s3.new_bucket()}/runs"
    quiet = subprocess.run([sys.executable, "-c", _OPEN_WITHOUT_REGION, location], capture_output=True, text=True)
    # (Icechunk's Rust tracing writes to stdout): one line, the error, and nothing else
    assert quiet.stdout.startswith("MissingRegionError") and "no region is set" in quiet.stdout
    assert len(quiet.stdout.strip().splitlines()) == 1 and not quiet.stderr.strip(), quiet.stdout + quiet.stderr
    # the user's ICECHUNK_LOG wins: the SDK's warnings (the noise kept out above) are there again
    monkeypatch.setenv("ICECHUNK_LOG", "warn")
    loud = subprocess.run([sys.executable, "-c", _OPEN_WITHOUT_REGION, location], capture_output=True, text=True)
    assert "no region is set" in loud.stdout
    assert "failed to load region" in loud.stdout + loud.stderr


def test_a_run_id_with_403_in_its_time_is_not_access_denied():
    """The digits 403 inside a branch name (a run started at 00:24:03) are no HTTP status: an outage's 503
    during a commit to that branch is a storage fault the run waits through, not "access denied"."""
    from vcdask.errors import StoreAccessDeniedError
    from vcdask.store._errors import translate

    what = "committing to branch 'run-20261125-002403-4e2050' of 's3://b/p'"
    error = RuntimeError(  # icechunk's messages name the branch too
        "session error: error getting object from object store service error: branch "
        'run-20261125-002403-4e2050: Error { code: "SlowDown", message: "Please reduce your request rate." }'
    )
    slow = translate(error, what)
    assert not isinstance(slow, StoreAccessDeniedError), slow
    for text in ("unhandled error (status 403)", "HTTP 403 Forbidden", "403: no"):
        assert isinstance(translate(RuntimeError(text), "reading 's3://b/p'"), StoreAccessDeniedError), text


# -- settings, checked before anything is opened ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("setting", "value", "error", "valid"),
    [
        ("commit_retries", -1, InvalidLocationError, "an integer >= 0"),
        ("commit_retries", 1.5, TypeError, "an integer >= 0"),
        ("max_tries", 0, InvalidLocationError, "an integer >= 1"),
        ("max_tries", "3", TypeError, "an integer >= 1"),
        ("max_tries", True, TypeError, "an integer >= 1"),
        ("chunk_bytes", 0, InvalidLocationError, "an integer >= 1 or a size"),
        ("chunk_bytes", -8, InvalidLocationError, "an integer >= 1 or a size"),
        ("chunk_bytes", 2.5, TypeError, "an integer >= 1 or a size"),
        ("chunk_bytes", "lots", TypeError, "an integer >= 1 or a size"),
        ("chunk_bytes", "0MiB", InvalidLocationError, "an integer >= 1 or a size"),
    ],
)
def test_a_bad_setting_is_refused_by_name_before_the_store_is_opened(tmp_path, setting, value, error, valid):
    with pytest.raises(error, match=rf"^{setting} must be {valid}.*, got {re.escape(repr(value))}$"):
        open_store(tmp_path / "s", **{setting: value})
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(("key", "value"), [("commit-retries", -1), ("max-tries", 0), ("chunk-bytes", "none")])
def test_a_bad_setting_in_the_config_is_refused_naming_the_config_key(tmp_path, key, value):
    with (
        dask.config.set({f"vcdask.store.{key}": value}),
        pytest.raises(
            ValueError if key != "chunk-bytes" else TypeError, match=rf"^the config value vcdask.store.{key} must be"
        ),
    ):
        open_store(tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_chunk_bytes_takes_a_size_in_dasks_spelling(tmp_path):
    assert open_store(tmp_path / "a", chunk_bytes="1KiB").chunk_bytes == 1024
    with dask.config.set({"vcdask.store.chunk-bytes": "8 kB"}):  # e.g. DASK_VCDASK__STORE__CHUNK_BYTES="8 kB"
        store = open_store(tmp_path / "b")
    assert store.chunk_bytes == 8000
    v = store.commit({"w": torch.arange(3000, dtype=torch.float32)})
    assert store.read(v).params["w"].tolist() == list(range(3000))


# -- names, holds, snapshots that are not versions ----------------------------------------------------------------
@pytest.mark.parametrize("name", ["", "a/b", "runs/x", "new\nline", "tab\there"])
def test_a_bad_branch_or_tag_name_is_a_valueerror_stating_the_rule(tmp_path, name):
    store = open_store(tmp_path / "s")
    v = store.commit({"w": torch.zeros(3)})
    rule = r"name must be 1 to 200 characters: ASCII letters, digits, space and \. _ \+ : = @ , - .*, got "
    with pytest.raises(ValueError, match="branch " + rule) as info:
        store.create_branch(name, v)
    assert not isinstance(info.value, OSError)
    with pytest.raises(ValueError, match="tag " + rule):
        store.tag(name, v)
    assert store.tags() == {} and sorted(store.branches()) == ["main"]
    store.create_branch("run-20260101-000000.a:b", v)  # what run ids and users' names look like still works
    store.tag("release 1.0", v)


@pytest.mark.parametrize(
    ("ttl", "error"),
    [
        (-5, ValueError),
        (0, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        ("1h", TypeError),
        (None, TypeError),
    ],
)
def test_a_hold_needs_a_finite_ttl_above_zero(tmp_path, ttl, error):
    store = open_store(tmp_path / "s")
    v = store.commit({"w": torch.zeros(3)})
    with pytest.raises(error, match=r"^ttl must be a finite number of seconds > 0, got "):
        store.hold(v, ttl=ttl)
    with store.hold(v, ttl=0.5) as held:
        assert held == v


def test_the_repositorys_root_snapshot_is_no_version(tmp_path):
    store = open_store(tmp_path / "s")
    store.commit({"w": torch.zeros(3)})
    *_, root = store._repo.ancestry(branch="main")
    for take in (store.version_nbytes, store.read_state):
        with pytest.raises(VersionNotFoundError, match=rf"'{root.id}' is not a vcdask version"):
            take(root.id)


def test_a_failed_side_file_request_keeps_its_unredacted_cause_out_of_the_traceback(tmp_path):
    """An SDK's error may quote a signed URL: the store error shows it redacted, and nothing shows the original."""
    from fsspec.implementations.local import LocalFileSystem

    from vcdask.store._credentials import forget_credentials, register_credentials
    from vcdask.store._files import SideFiles

    secret = f"sig-{uuid.uuid4().hex}"
    location = f"s3://bucket-{uuid.uuid4().hex[:8]}/p"
    register_credentials(location, secret_access_key=secret)
    try:
        (tmp_path / "runs").write_text("a file where the folder should be")
        files = SideFiles(LocalFileSystem(), str(tmp_path / "runs"), "the store")
        with pytest.raises(StoreError) as info:
            files.put(f"x?sig={secret}", b"data")  # the OS error names the path, and the path holds the secret
        assert "***" in str(info.value) and secret not in str(info.value)
        assert secret not in "".join(traceback.format_exception(info.value))
    finally:
        forget_credentials(location)
