"""Where snapshots are stored: a directory (local, or shared over a POSIX file system), or a
prefix of an object store (`gs://bucket/path`, `s3://bucket/path`) through TensorStore's drivers.

The two commit differently. A directory commits snapshot `<version>` by renaming the finished
`<version>.orbax-checkpoint-tmp` to it, so a listing only ever shows finished ones. An object
store has no rename: a snapshot is written in place under `<version>/` and committed by writing
`<version>/commit_success.txt` last (Orbax's marker on object stores). Its listings show only
versions with the marker, and unlisting one deletes the marker before anything else.

Keys are '/'-separated paths relative to the store's root. On S3, the AWS SDKs' variables say
where and who: `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` an S3-compatible endpoint,
`AWS_REGION` or `AWS_DEFAULT_REGION` its region, `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` the
keys (without them, TensorStore's default chain: profile, instance metadata). On GCS, Google's
application-default credentials; `TENSORSTORE_GCS_HTTP_URL` names another endpoint.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import tensorstore as ts

SCHEMES = ("gs", "s3")
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax's: its step listings skip these
COMMIT_MARKER = "commit_success.txt"  # Orbax's on object stores
_COPY_BATCH = 8  # keys copied at once: data files are up to 64 MB each
# A store that stops answering on an open connection is an error after these, not a hang: by
# default TensorStore waits on it for good (JAX sets the same variables on TPUs). With the retries
# below (3 attempts), a dead store fails a request after about 3 minutes.
_STALL_LIMITS = {"TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": "60", "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES": "256"}
_RETRIES = {"max_retries": 3, "initial_delay": "1s", "max_delay": "8s"}


def is_url(location: str | Path) -> bool:
    return "://" in str(location)


def check_location(location: str) -> None:
    """Raises ValueError naming what is wrong with a snapshot location that is a URL."""
    if is_url(location):
        scheme, _, rest = location.partition("://")
        if scheme not in SCHEMES:
            schemes = " or ".join(f"{s}://" for s in SCHEMES)
            raise ValueError(f"{location}: snapshots go to a directory or to a {schemes} bucket, not to a "
                             f"{scheme}:// URL")
        if not rest.split("/")[0] or ".." in rest.split("/"):
            raise ValueError(f"{location}: give the bucket and a path in it, without '..' "
                             f"(e.g. {scheme}://bucket/snapshots)")


def open_store(location: str | Path) -> DirectoryStore | ObjectStore:
    return ObjectStore(str(location)) if is_url(location) else DirectoryStore(location)


def _successor(prefix: str) -> str:
    """The first key after every key that starts with `prefix` ('' for none: the end)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1) if prefix else ""


class DirectoryStore:
    """Snapshots in a directory, each committed by a rename."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().absolute()

    def __str__(self) -> str:
        return str(self.root)

    def location(self, key: str) -> Path:
        return self.root / key

    def kvstore_base(self, key: str) -> dict:
        return {"driver": "file", "path": f"{self.root / key}/"}

    def exists(self) -> bool:
        return self.root.is_dir()

    def versions(self) -> list[int]:
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        return sorted(int(e.name) for e in entries if e.name.isdigit() and e.is_dir())

    def committed(self, version: int) -> bool:
        return (self.root / str(version)).is_dir()

    def open_for_writing(self) -> None:
        """Makes the directory and deletes what a writer that was killed left."""
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob(f"*{TMP_SUFFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def staging(self, version: int) -> str:
        """Where snapshot `version` is written before its commit."""
        return f"{version}{TMP_SUFFIX}"

    def begin(self, version: int) -> None:
        tmp = self.root / self.staging(version)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "weights").mkdir(parents=True)

    def discard(self, version: int) -> None:
        shutil.rmtree(self.root / self.staging(version), ignore_errors=True)

    def write(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def read(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            return None

    def subdirectories(self, key: str, prefix: str) -> list[str]:
        return sorted(f"{key}/{p.name}" for p in (self.root / key).glob(f"{prefix}*"))

    def commit(self, version: int) -> None:
        final = self.root / str(version)
        if final.exists():
            self.delete(self.unlist(version))
        os.rename(self.root / self.staging(version), final)  # the commit: readers list it from now on

    def unlist(self, version: int) -> Path | None:
        """Takes a snapshot out of the listings at once (a rename, so no reader lists half of one);
        returns what to `delete` (a writer's next start deletes it, if nothing else does)."""
        path = self.root / str(version)
        doomed = path.with_name(f"{path.name}{TMP_SUFFIX}-deleted-{time.monotonic_ns()}")
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return None
        return doomed

    def delete(self, doomed: Path | None) -> None:
        if doomed is not None:
            shutil.rmtree(doomed, ignore_errors=True)


class ObjectStore:
    """Snapshots under a `gs://` or `s3://` prefix, each committed by a marker written last."""

    def __init__(self, url: str):
        check_location(url)
        for name, value in _STALL_LIMITS.items():  # read when TensorStore makes its first HTTP request
            os.environ.setdefault(name, value)
        self.url = url.rstrip("/")
        self._base = _url_spec(self.url + "/")
        self._kvstore: ts.KvStore | None = None

    def __str__(self) -> str:
        return self.url

    @property
    def kvstore(self) -> ts.KvStore:
        if self._kvstore is None:
            self._kvstore = ts.KvStore.open(self._base).result()
        return self._kvstore

    def location(self, key: str) -> str:
        return f"{self.url}/{key}"

    def kvstore_base(self, key: str) -> dict:
        return {**self._base, "path": f"{self._base['path']}{key}/"}

    def exists(self) -> bool:
        return True  # a prefix is there as soon as something is written under it

    def _keys(self, prefix: str = "") -> list[str]:
        keys = self.kvstore.list(ts.KvStore.KeyRange(prefix, _successor(prefix))).result()
        return [k.decode() for k in keys]

    def versions(self) -> list[int]:
        marker = re.compile(rf"(\d+)/{re.escape(COMMIT_MARKER)}")
        return sorted(int(m.group(1)) for k in self._keys() if (m := marker.fullmatch(k)))

    def committed(self, version: int) -> bool:
        return self.read(f"{version}/{COMMIT_MARKER}") is not None

    def open_for_writing(self) -> None:
        """Deletes the versions without a marker: writes or deletions that did not finish."""
        keys = self._keys()
        committed = {k.split("/")[0] for k in keys if k.count("/") == 1 and k.endswith(f"/{COMMIT_MARKER}")}
        for top in sorted({k.split("/")[0] for k in keys if "/" in k} - committed):
            self.delete(f"{top}/")

    def staging(self, version: int) -> str:
        return str(version)

    def begin(self, version: int) -> None:
        self.delete(self.unlist(version))
        self.discard(version)

    def discard(self, version: int) -> None:
        self.delete(f"{version}/")

    def write(self, key: str, data: bytes) -> None:
        self.kvstore.write(key, data).result()

    def read(self, key: str) -> bytes | None:
        read = self.kvstore.read(key).result()
        return read.value if read.state == "value" else None

    def subdirectories(self, key: str, prefix: str) -> list[str]:
        start = f"{key}/{prefix}"
        return sorted({k[:k.index("/", len(start))] for k in self._keys(start) if "/" in k[len(start):]})

    def commit(self, version: int) -> None:
        self.write(f"{version}/{COMMIT_MARKER}", b"")

    def unlist(self, version: int) -> str | None:
        marker = f"{version}/{COMMIT_MARKER}"
        if self.read(marker) is None:
            return None
        self.kvstore.delete_range(ts.KvStore.KeyRange(marker, marker + "\0")).result()
        return f"{version}/"

    def delete(self, doomed: str | None) -> None:
        if doomed is not None:
            self.kvstore.delete_range(ts.KvStore.KeyRange(doomed, _successor(doomed))).result()


def _url_spec(url: str) -> dict:
    """TensorStore's kvstore spec of `url`; on S3 with what the AWS variables say (TensorStore
    itself reads none of them but the keys)."""
    spec = ts.KvStore.Spec(url).to_json()
    spec["context"] = {f"{spec['driver']}_request_retries": _RETRIES}
    if spec["driver"] == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if endpoint:
            spec["endpoint"] = endpoint
        if region:
            spec["aws_region"] = region
        if os.environ.get("AWS_ACCESS_KEY_ID"):  # else the default chain (profile files, instance metadata)
            spec["aws_credentials"] = {"type": "environment"}
    return spec


def copy_keys(source: DirectoryStore | ObjectStore, source_key: str, target: DirectoryStore | ObjectStore,
              target_key: str) -> None:
    """Copies every key under `source_key` of `source` to the same place under `target_key` of
    `target`, except an object store's commit marker; a few at once."""
    src = ts.KvStore.open(source.kvstore_base(source_key)).result()
    dst = ts.KvStore.open(target.kvstore_base(target_key)).result()
    keys = [k for k in src.list().result() if k != COMMIT_MARKER.encode()]
    for i in range(0, len(keys), _COPY_BATCH):
        batch = keys[i:i + _COPY_BATCH]
        reads = [src.read(k) for k in batch]
        for write in [dst.write(k, read.result().value) for k, read in zip(batch, reads)]:
            write.result()
