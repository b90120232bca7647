"""RUN/run.json: the seeds, and the versions and devices each session of a run ran on."""

import base64
import hashlib
import importlib.metadata
import json
import sys

from jaxrl.run.config import TrainConfig
from jaxrl.run.record import differences, imported_distribution, record_session
from jaxrl.run.run_dir import RunDir
from jaxrl.run.typed_config import from_dict


def config(**extra) -> TrainConfig:
    return from_dict(TrainConfig, {"run_dir": "r", "model": {"dir": "m", "tiny": {"seed": 3}}, "seed": 7,
                                   "envs": [{"name": "echo", "bundled": "echo", "seed": 5}], **extra})


def test_a_fresh_run_starts_the_record_and_a_resume_adds_a_session(tmp_path):
    run = RunDir.create(tmp_path / "run")
    record_session(run, config(), None)
    record_session(run, config(), 4)
    record = json.loads(run.record.read_text())
    assert {k: v for k, v in record["seeds"].items() if k != "sampling"} == {
        "seed": 7, "data.seed": 0, "model.tiny.seed": 3, "envs.echo.seed": 5}
    assert "derive_seed(seed, group id)" in record["seeds"]["sampling"]
    assert [s["start_step"] for s in record["sessions"]] == [0, 4]
    session = record["sessions"][0]
    assert session["packages"]["jax"] == importlib.metadata.version("jax") and session["python"]
    assert session["packages"]["openenv"] == importlib.metadata.version("openenv")  # what `import openenv` loads
    assert session["devices"].startswith("cpu x")
    record_session(run, config(), None)  # started over: a new record
    assert len(json.loads(run.record.read_text())["sessions"]) == 1
    assert differences(run) == []


def test_differences_name_what_no_session_recorded(tmp_path):
    run = RunDir.create(tmp_path / "run")
    assert differences(run) is None  # no record
    record_session(run, config(), None)
    record = json.loads(run.record.read_text())
    record["sessions"][0]["packages"]["jax"] = "0.0.1"
    record["sessions"][0]["devices"] = "TPU v5 lite x4"
    run.record.write_text(json.dumps(record))
    now = importlib.metadata.version("jax")
    assert differences(run) == ["devices cpu x8 (recorded TPU v5 lite x4)", f"jax {now} (recorded 0.0.1)"]


def test_of_two_distributions_that_install_one_directory_the_imported_one_is_recorded(tmp_path, monkeypatch):
    """openenv-core and openenv both install `openenv/`: the one whose recorded file is on disk counts."""
    code = b"VERSION = 2\n"
    (tmp_path / "twinpkg").mkdir()
    (tmp_path / "twinpkg" / "__init__.py").write_bytes(code)
    for name, version, content in (("twinpkg_core", "0.3.0", b"VERSION = 1\n"), ("twinpkg", "0.10.0", code)):
        info = tmp_path / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
        (info / "RECORD").write_text(f"twinpkg/__init__.py,sha256={digest},{len(content)}\n")
        (info / "top_level.txt").write_text("twinpkg\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    dist = imported_distribution("twinpkg")
    assert (dist.metadata["Name"], dist.version) == ("twinpkg", "0.10.0")
    # Named candidates (checked before every installed distribution is listed) give the same answer,
    # also when the one named is not the owner or is not installed.
    for names in (("twinpkg_core", "twinpkg"), ("twinpkg_core",), ("not_installed_here",)):
        assert imported_distribution("twinpkg", names).metadata["Name"] == "twinpkg", names
    assert imported_distribution("no_such_module_here") is None
    assert "twinpkg" not in sys.modules  # found, not imported
