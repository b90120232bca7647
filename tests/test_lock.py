"""The locks decide what is installed (scripts/lock.sh writes them, scripts/setup*.sh install from them)."""

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
VENVS = ("main", "vllm", "trl", "docs")


def locked(venv: str) -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "locks" / f"{venv}.txt").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line)
        assert match, f"locks/{venv}.txt: {line!r} is not an exact pin (name==version)"
        pins[canonicalize_name(match[1])] = Version(match[2])
    return pins


def asked_for(venv: str) -> list[Requirement]:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "requirements.py"), venv], check=True,
                         capture_output=True, text=True).stdout
    return [Requirement(line) for line in out.splitlines()]


@pytest.mark.parametrize("venv", VENVS)
def test_every_requirement_is_locked_within_its_range(venv):
    pins = locked(venv)
    for req in asked_for(venv):
        name = canonicalize_name(req.name)
        assert name in pins, f"locks/{venv}.txt has no pin for {req.name}: rerun scripts/lock.sh {venv}"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"locks/{venv}.txt pins {req.name}=={pins[name]} outside {req}: rerun scripts/lock.sh {venv}")


def test_torch_is_locked_to_the_cpu_wheel():
    for venv in ("main", "vllm", "trl"):  # docs installs no torch
        assert locked(venv)["torch"] == Version("2.13.0+cpu"), f"locks/{venv}.txt: torch is not the CPU wheel"


def test_this_environment_holds_the_locked_versions():
    pins = locked("main")
    differ = []
    for dist in importlib.metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name in pins and Version(dist.version) != pins[name]:
            differ.append(f"{name} {dist.version} (locked {pins[name]})")
    assert not differ, f"installed versions differ from locks/main.txt: {differ}; run scripts/setup.sh test"
    installed = {canonicalize_name(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    missing = [req.name for req in asked_for("main") if canonicalize_name(req.name) not in installed]
    assert not missing, f"{missing} are not installed: run scripts/setup.sh test"
