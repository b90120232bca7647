"""The layout of a run directory: one place that names every file a run writes.

```
RUN/
  config.yaml      the resolved run config
  run.json         its seeds, and the versions and devices each session ran on (jaxrl.run.record)
  metrics.jsonl    one JSON object per logged step
  checkpoints/     train checkpoints (jaxrl.checkpoints.TrainCheckpointer)
  snapshots/       weight snapshots for the bridge (jaxrl.snapshots.SnapshotWriter), or only the
                   last one served when they live in memory while the run trains
  tokenizer/       the run's tokenizer, written with `tokenizer.save_pretrained`
  base-model/      a LoRA run whose warm start trained every weight (`sft.train_all`): the
                   warm-started model, as a Hugging Face model directory, that its bridges serve and
                   its adapters sit on
  logs/            the children's logs, train.log (the trainer's warnings and library errors) and
                   train_error.log (the traceback of a run that failed)
```

While a run trains, its snapshots live where `snapshot_directory` says: by default, when the run
starts its own bridges on this host, in a directory of its own under /dev/shm (memory: publishing
costs no disk, reading no disk), removed when the run ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from jaxrl.snapshot_store import is_url

log = logging.getLogger("jaxrl.run")
SHM = Path("/dev/shm")
SHM_PREFIX = "jaxrl-snapshots-"  # + the trainer's pid + "-" + a random part


@dataclasses.dataclass(frozen=True)
class RunDir:
    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    @classmethod
    def create(cls, path: str | Path) -> RunDir:
        """The run directory at `path`, with its subdirectories made (existing ones are kept)."""
        run = cls(path)
        for directory in (run.checkpoints, run.snapshots, run.tokenizer, run.logs):
            directory.mkdir(parents=True, exist_ok=True)
        return run

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def snapshots(self) -> Path:
        return self.path / "snapshots"

    @property
    def tokenizer(self) -> Path:
        return self.path / "tokenizer"

    @property
    def base_model(self) -> Path:
        return self.path / "base-model"

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def record(self) -> Path:
        return self.path / "run.json"


def disk_full(e: BaseException) -> bool:
    """Whether `e` (or an exception it came from) is a full disk; TensorStore's write errors are
    not OSErrors, but they carry the OS error's text."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC or "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@contextlib.contextmanager
def snapshot_directory(run: RunDir, configured: str | None, local_bridges: bool, needs_bytes: int = 0,
                       shm: Path = SHM) -> Iterator[tuple[Path | str, bool]]:
    """Where the run's snapshots live while it trains, and whether that is a memory directory of
    its own: (directory, in_memory).

    `configured` (the `snapshot_dir` key: a path, or a gs:// or s3:// URL), if set; else, with
    `local_bridges` (this host's one process starts the bridges) and a writable `shm` with room for
    `needs_bytes` in at most half of its free space and of the memory available, a fresh directory
    under `shm`, removed on exit however the run ends (one left by a run killed outright goes at
    the next run's start); else `run.snapshots`, which any bridge that reads the run directory can
    read.
    """
    _remove_orphans(shm)
    if configured:
        yield (configured.rstrip("/") if is_url(configured) else Path(configured).expanduser().absolute()), False
        return
    if not (local_bridges and shm.is_dir() and os.access(shm, os.W_OK)):
        yield run.snapshots.absolute(), False
        return
    if needs_bytes > _memory_room(shm) / 2:
        log.warning("snapshots go to %s: %.1f GB of them would not fit in memory (%s)", run.snapshots,
                    needs_bytes / 1e9, shm)
        yield run.snapshots.absolute(), False
        return
    directory = Path(tempfile.mkdtemp(prefix=f"{SHM_PREFIX}{os.getpid()}-", dir=shm))
    try:
        yield directory, True
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _memory_room(shm: Path) -> int:
    """Bytes that files under `shm` (tmpfs: memory) may take: its free space, and no more than
    the memory available."""
    stat = os.statvfs(shm)
    room = stat.f_bavail * stat.f_frsize
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return room
    return min(room, available)


def _remove_orphans(shm: Path) -> None:
    """Removes this user's snapshot directories under `shm` whose run (process) is gone."""
    try:
        entries = list(os.scandir(shm))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(SHM_PREFIX):
            continue
        pid = entry.name[len(SHM_PREFIX):].split("-")[0]
        try:
            if not pid.isdigit() or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:  # alive but not ours to signal, or the entry went away
            continue
