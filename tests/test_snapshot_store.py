"""Snapshot stores: a directory and an S3 bucket (moto's server on 127.0.0.1) publish, prune,
replace, delete and copy alike; on the bucket a snapshot is listed only once its marker is
written, and what an interrupted write left is deleted by the next writer."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import boto3
import numpy as np
import pytest
from flax import nnx

from object_store import s3_server
from jaxrl.models import Decoder, to_hf_tensors
from jaxrl.snapshot_store import COMMIT_MARKER, check_location, open_store
from jaxrl.snapshots import SnapshotError, SnapshotReader, SnapshotWriter, copy_snapshot, delete_snapshot
from jaxrl.tiny import tiny_config

BUCKET = "snapshots"


@pytest.fixture(scope="module")
def s3():
    """The S3 server's variables, set in this process for the module's tests."""
    with s3_server(BUCKET) as variables, pytest.MonkeyPatch.context() as mp:
        for k, v in variables.items():
            mp.setenv(k, v)
        yield variables


def _objects(s3, prefix: str) -> list[str]:
    """The keys under `prefix` in the bucket, listed by boto3 (not by the code under test)."""
    client = boto3.client("s3", endpoint_url=s3["AWS_ENDPOINT_URL"], region_name=s3["AWS_REGION"])
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"][len(prefix):] for page in pages for o in page.get("Contents", []))


def _params(cfg, seed):
    return nnx.state(Decoder(cfg, nnx.Rngs(seed)), nnx.Param)


def _assert_holds(snapshot, cfg, seed):
    expected = {k: np.asarray(v) for k, v in to_hf_tensors(cfg, _params(cfg, seed)).items()}
    assert list(snapshot.tensors) == list(expected)
    for name, want in expected.items():
        np.testing.assert_array_equal(snapshot.tensors[name], want, err_msg=name)


@pytest.fixture(params=["directory", "s3"])
def location(request, tmp_path):
    if request.param == "directory":
        return str(tmp_path / "snapshots")
    request.getfixturevalue("s3")
    return f"s3://{BUCKET}/{request.node.name.replace('[', '-').rstrip(']')}"


def test_publish_prune_replace_and_delete_alike_in_a_directory_and_a_bucket(location):
    cfg = tiny_config("qwen3")
    writer = SnapshotWriter(location, cfg, keep=2)
    reader = SnapshotReader(location)
    for version, in_use, kept in [(1, [], [1]), (2, [], [1, 2]), (3, [1], [1, 2, 3]), (4, [], [3, 4])]:
        where = writer.publish(_params(cfg, version), version, in_use=in_use)
        assert str(where) == f"{location}/{version}"
        assert reader.versions() == writer.versions() == kept, version
    _assert_holds(reader.load(), cfg, 4)
    writer.publish(_params(cfg, 9), 4)  # published again: replaced
    _assert_holds(reader.load(4), cfg, 9)
    writer.publish(_params(cfg, 5), 5, wait=False)
    writer.wait()
    assert reader.versions() == [4, 5]
    writer.delete(4)
    delete_snapshot(location, 7)  # not there: nothing to do
    writer.close()
    assert reader.versions() == [5]
    with pytest.raises(SnapshotError, match=rf"{location}/4: no finished snapshot with version 4 \(have \[5\]\)"):
        reader.load(4)
    _assert_holds(reader.load(), cfg, 5)


def test_a_bucket_holds_only_committed_snapshots_and_nothing_of_pruned_ones(s3):
    cfg = tiny_config("qwen3")
    url = f"s3://{BUCKET}/run/"
    writer = SnapshotWriter(url, cfg, keep=1)
    for version in (1, 2):
        writer.publish(_params(cfg, version), version)
    writer.close()
    keys = _objects(s3, "run/")
    assert {k.split("/")[0] for k in keys} == {"2"}  # version 1's objects are all gone
    assert {"2/commit_success.txt", "2/manifest/metadata", "2/_CHECKPOINT_METADATA", "2/weights/_METADATA",
            "2/weights/manifest.ocdbt"} <= set(keys)
    assert any(k.startswith("2/weights/d/") for k in keys)  # the data files


def test_a_write_cut_off_before_its_marker_is_never_listed_and_the_next_writer_deletes_it(s3):
    cfg = tiny_config("qwen3")
    url = f"s3://{BUCKET}/cut"
    writer = SnapshotWriter(url, cfg)
    for version in (1, 2):
        writer.publish(_params(cfg, version), version)
    writer.close()
    # What a writer killed after the data and before the marker leaves (version 2 with no marker):
    boto3.client("s3", endpoint_url=s3["AWS_ENDPOINT_URL"], region_name=s3["AWS_REGION"]).delete_object(
        Bucket=BUCKET, Key=f"cut/2/{COMMIT_MARKER}")
    reader = SnapshotReader(url)
    assert reader.versions() == [1]
    with pytest.raises(SnapshotError, match=r"cut/2: no finished snapshot with version 2 \(have \[1\]\)"):
        reader.load(2)
    assert any(k.startswith("2/") for k in _objects(s3, "cut/"))
    SnapshotWriter(url, cfg).close()
    assert {k.split("/")[0] for k in _objects(s3, "cut/")} == {"1"}
    _assert_holds(reader.load(), cfg, 1)


def test_copies_between_a_bucket_and_a_directory_are_committed_whole(s3, tmp_path):
    cfg = tiny_config("qwen3")
    url = f"s3://{BUCKET}/copies"
    writer = SnapshotWriter(url, cfg)
    for version in (1, 2, 3):
        writer.publish(_params(cfg, version), version)
    writer.close()
    for version in (1, 2, 3):
        copy_snapshot(url, version, tmp_path / "run", keep=2)
    assert SnapshotReader(tmp_path / "run").versions() == [2, 3]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["2", "3"]
    _assert_holds(SnapshotReader(tmp_path / "run").load(3), cfg, 3)
    back = copy_snapshot(tmp_path / "run", 2, f"{url}-back")
    assert back == f"{url}-back/2"
    _assert_holds(SnapshotReader(f"{url}-back").load(), cfg, 2)
    assert f"2/{COMMIT_MARKER}" in _objects(s3, "copies-back/")
    with pytest.raises(SnapshotError, match=r"copies/9: no finished snapshot with version 9 \(have \[1, 2, 3\]\)"):
        copy_snapshot(url, 9, tmp_path / "run")


def test_an_empty_bucket_prefix_has_no_snapshots(s3):
    reader = SnapshotReader(f"s3://{BUCKET}/nothing-here")
    assert reader.versions() == [] and reader.latest_version() is None
    with pytest.raises(SnapshotError, match="s3://snapshots/nothing-here: no finished snapshot yet"):
        reader.load()


def test_a_bucket_that_stops_answering_is_a_one_line_error_not_a_hang():
    with socket.socket() as silent:  # takes connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{silent.getsockname()[1]}",
               "AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
               "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": "1"}  # 60 s by default: a long test
        code = ("from jaxrl.snapshots import SnapshotError, SnapshotReader\n"
                "try:\n    SnapshotReader('s3://bucket/run').load(1)\nexcept SnapshotError as e:\n    print(e)")
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("s3://bucket/run/1: cannot be read (") and "retry" in lines[0], lines
    assert time.monotonic() - started < 60  # 3 attempts of 1 s and the waits between them


def test_a_bucket_gone_between_publishes_fails_the_next_one_in_one_line(monkeypatch):
    cfg = tiny_config("qwen3")
    with s3_server("going") as variables:
        for k, v in variables.items():
            monkeypatch.setenv(k, v)
        writer = SnapshotWriter("s3://going/run", cfg)
        writer.publish(_params(cfg, 1), 1)
    # The server is stopped: connections are refused (3 attempts, 1 s and 2 s apart).
    with pytest.raises(SnapshotError, match=r"^s3://going/run/2: cannot be written \(ValueError: .*retry attempts "
                                            r"failed.*Could not connect"):
        writer.publish(_params(cfg, 2), 2)


@pytest.mark.parametrize("location, message", [
    ("http://host/x", "not to a http:// URL"),
    ("s3://", "give the bucket and a path in it"),
    ("gs://bucket/a/../b", "without '..'"),
])
def test_bad_locations_are_named(location, message):
    with pytest.raises(ValueError, match=message):
        check_location(location)
    with pytest.raises(SnapshotError, match=message):
        SnapshotReader(location)


def test_a_directory_and_a_url_open_the_store_they_name(tmp_path):
    assert str(open_store(tmp_path / "a")) == str(tmp_path / "a")
    assert str(open_store("gs://bucket/run/snapshots/")) == "gs://bucket/run/snapshots"
    assert open_store("gs://bucket/run/snapshots").kvstore_base("3/weights") == {
        "driver": "gcs", "bucket": "bucket", "path": "run/snapshots/3/weights/",
        "context": {"gcs_request_retries": {"max_retries": 3, "initial_delay": "1s", "max_delay": "8s"}}}
