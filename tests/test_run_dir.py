"""The run directory layout."""

import dataclasses

import pytest

from jaxrl.run.run_dir import RunDir


def test_layout_names_every_part(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    assert run.path == tmp_path / "run"
    assert run.checkpoints == tmp_path / "run" / "checkpoints"
    assert run.snapshots == tmp_path / "run" / "snapshots"
    assert run.tokenizer == tmp_path / "run" / "tokenizer"
    assert run.config == tmp_path / "run" / "config.yaml"
    assert run.metrics == tmp_path / "run" / "metrics.jsonl"
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
