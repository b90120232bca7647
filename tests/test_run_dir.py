"""The run directory layout, and where a run's snapshots live while it trains."""

import dataclasses
import os
import subprocess
import sys

import pytest

from jaxrl.run.run_dir import SHM_PREFIX, RunDir, snapshot_directory


def test_layout_names_every_part(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    assert run.path == tmp_path / "run"
    assert run.checkpoints == tmp_path / "run" / "checkpoints"
    assert run.snapshots == tmp_path / "run" / "snapshots"
    assert run.tokenizer == tmp_path / "run" / "tokenizer"
    assert run.config == tmp_path / "run" / "config.yaml"
    assert run.metrics == tmp_path / "run" / "metrics.jsonl"
    assert run.record == tmp_path / "run" / "run.json"
    assert run.base_model == tmp_path / "run" / "base-model"
    assert not run.path.exists()  # naming the layout creates nothing


def test_create_makes_the_directories_and_keeps_existing_files(tmp_path):
    run = RunDir.create(tmp_path / "a" / "run")
    assert run.checkpoints.is_dir() and run.snapshots.is_dir() and run.tokenizer.is_dir()
    run.config.write_text("seed: 1\n")
    again = RunDir.create(run.path)
    assert again == run and run.config.read_text() == "seed: 1\n"


def test_is_frozen(tmp_path):
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunDir(tmp_path).path = tmp_path / "other"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_snapshots_live_in_memory_only_for_a_run_that_starts_its_bridges(tmp_path):
    run, shm = RunDir.create(tmp_path / "run"), tmp_path / "shm"
    shm.mkdir()
    with snapshot_directory(run, None, local_bridges=True, needs_bytes=1 << 20, shm=shm) as (directory, in_memory):
        assert in_memory and directory.parent == shm and directory.is_dir()
        assert directory.name.startswith(f"{SHM_PREFIX}{os.getpid()}-")
    assert not directory.exists()  # removed with the run
    for configured, local, where, needs, expected in [
        (None, False, shm, 0, run.snapshots),  # remote bridges read the run directory
        (None, True, tmp_path / "no-shm", 0, run.snapshots),  # no /dev/shm
        (str(tmp_path / "mine"), True, shm, 0, tmp_path / "mine"),  # the user's choice
        (None, True, shm, 1 << 60, run.snapshots),  # snapshots too big for the memory there is
    ]:
        with snapshot_directory(run, configured, local_bridges=local, needs_bytes=needs,
                                shm=where) as (directory, in_memory):
            assert directory == expected.absolute() and not in_memory
        assert list(shm.iterdir()) == []


def test_a_memory_directory_goes_however_the_run_ends_and_orphans_go_at_the_next_start(tmp_path):
    run, shm = RunDir.create(tmp_path / "run"), tmp_path / "shm"
    shm.mkdir()
    with pytest.raises(KeyboardInterrupt):
        with snapshot_directory(run, None, local_bridges=True, shm=shm) as (directory, _):
            (directory / "7").mkdir()
            raise KeyboardInterrupt
    assert list(shm.iterdir()) == []
    # A run killed outright leaves its directory; the next run's start removes it (its process is
    # gone), and nothing else: a live run's, or what is not ours.
    orphan = shm / f"{SHM_PREFIX}{_dead_pid()}-abc"
    live = shm / f"{SHM_PREFIX}{os.getpid()}-def"
    other = shm / "something-else"
    for d in (orphan, live, other):
        (d / "3").mkdir(parents=True)
    with snapshot_directory(run, None, local_bridges=False, shm=shm):
        assert sorted(p.name for p in shm.iterdir()) == sorted([live.name, other.name])
