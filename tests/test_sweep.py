"""Sweeps: expansion, run names, bad specs, configs resolved before anything runs, and a real run."""

from __future__ import annotations

import dataclasses
import shlex
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from jaxrl.run.sweep import expand, run_names, run_sweep, write_configs
from jaxrl.run.typed_config import ConfigError, load, to_dict


@dataclasses.dataclass(frozen=True)
class Learner:
    lr: float = 1e-3

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")


@dataclasses.dataclass(frozen=True)
class Train:
    run_dir: str = "runs/default"
    learner: Learner = dataclasses.field(default_factory=Learner)
    group_size: int = 4
    steps: int = 3
    fail: bool = False


def resolve(base: Path, overrides: list) -> dict:
    return to_dict(load(Train, base, overrides))


def _sweep(tmp_path, body: str, name="s.yaml") -> Path:
    (tmp_path / "base.yaml").write_text("learner:\n  lr: 1e-3\nsteps: 3\n")
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_grid_expands_to_the_cartesian_product_in_key_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _sweep(tmp_path, """
        base: base.yaml
        grid:
          learner.lr: [1e-5, 3e-5]
          group_size: [4, 8]
        set: {steps: 2}
    """)
    spec, runs = expand(path)
    assert spec.name == "s" and spec.out_dir == "runs/sweeps/s" and spec.metric == "reward/mean"
    assert [r.name for r in runs] == ["lr=1e-05_group_size=4", "lr=1e-05_group_size=8",
                                      "lr=3e-05_group_size=4", "lr=3e-05_group_size=8"]
    assert runs[1].overrides == {"steps": 2, "learner.lr": 1e-5, "group_size": 8}
    assert runs[1].run_dir == Path("runs/sweeps/s/lr=1e-05_group_size=8")
    assert runs[1].config_path == runs[1].run_dir / "config.yaml"
    assert runs[1].base == tmp_path / "base.yaml"


def test_runs_list_and_its_names(tmp_path):
    path = _sweep(tmp_path, f"""
        name: explicit
        base: base.yaml
        out_dir: {tmp_path / "out"}
        runs:
          - {{learner.lr: 1e-5, group_size: 4}}
          - {{learner.lr: 1e-4, group_size: 4}}
          - {{learner.lr: 1e-4, group_size: 4, steps: 9}}
        metric: reward/max
    """)
    spec, runs = expand(path)
    assert spec.metric == "reward/max"
    # Only the differing keys name a run; group_size is the same everywhere.
    assert [r.name for r in runs] == ["lr=1e-05", "lr=0.0001", "lr=0.0001_steps=9"]
    assert [r.run_dir for r in runs] == [tmp_path / "out" / r.name for r in runs]


def test_run_names_are_safe_file_names_and_unique():
    assert run_names([{"model.path": "Qwen/Qwen3-0.6B", "a.flag": True, "b": None, "stop": ["</a>", "x y"]},
                      {"model.path": "m", "a.flag": False, "b": 1, "stop": []}]) == [
        "path=Qwen-Qwen3-0.6B_flag=true_b=null_stop=-a--x-y", "path=m_flag=false_b=1_stop="]
    # Two keys with the same last part keep their full names; repeated runs get a suffix.
    assert run_names([{"actor.lr": 1, "critic.lr": 2}, {"actor.lr": 2, "critic.lr": 3}]) == [
        "actor.lr=1_critic.lr=2", "actor.lr=2_critic.lr=3"]
    assert run_names([{"x": 1}, {"x": 1}]) == ["x=1", "x=1_2"]
    assert run_names([{}]) == ["base"]


@pytest.mark.parametrize("body,message", [
    ("base: base.yaml\n", r"s\.yaml: a sweep needs exactly one of `grid:` .* it has neither$"),
    ("base: base.yaml\ngrid: {a: [1]}\nruns: [{a: 1}]\n", r"it has both$"),
    ("base: base.yaml\ngrid: {learner.lr: 1e-5}\n",
     r"s\.yaml: config key 'grid\.learner\.lr': expected a list, got 1e-05$"),
    ("base: base.yaml\ngrid: {learner.lr: []}\n", r"grid key 'learner\.lr' has no values"),
    ("base: base.yaml\nruns: []\n", r"`runs:` is empty"),
    ("base: base.yaml\nruns: [lr=1]\n", r"config key 'runs\.0': expected a mapping, got 'lr=1'$"),
    ("base: nope.yaml\nruns: [{a: 1}]\n",
     r"base config .*nope\.yaml not found \(`base:` is relative to the sweep file\)$"),
    ("grid: {a: [1]}\n", r"missing required config key 'base'"),
    ("base: base.yaml\ngird: {a: [1]}\n", r"unknown config key 'gird' \(did you mean 'grid'\?"),
])
def test_bad_specs_are_refused_with_the_reason(tmp_path, body, message):
    with pytest.raises(ConfigError, match=message):
        expand(_sweep(tmp_path, body))


def test_dry_run_writes_every_config_and_prints_the_commands(tmp_path, capsys):
    out = tmp_path / "out"
    path = _sweep(tmp_path, f"""
        base: base.yaml
        out_dir: {out}
        grid: {{learner.lr: [1e-5, 3e-5], group_size: [4, 8]}}
    """)
    assert run_sweep(path, resolve, dry_run=True, train_command=["false"]) == 0
    commands = capsys.readouterr().out.splitlines()
    names = ["lr=1e-05_group_size=4", "lr=1e-05_group_size=8", "lr=3e-05_group_size=4", "lr=3e-05_group_size=8"]
    assert commands == [shlex.join(["jaxrl", "train", str(out / n / "config.yaml")]) for n in names]
    config = yaml.safe_load((out / names[3] / "config.yaml").read_text())
    assert config == {"run_dir": str(out / names[3]), "learner": {"lr": 3e-5}, "group_size": 8,
                      "steps": 3, "fail": False}


def test_a_bad_override_fails_every_run_before_anything_is_written(tmp_path):
    path = _sweep(tmp_path, f"""
        base: base.yaml
        out_dir: {tmp_path / "out"}
        grid: {{learner.lr: [1e-5, -1.0, -2.0], group_size: [4]}}
    """)
    spec, runs = expand(path)
    with pytest.raises(ConfigError) as error:
        write_configs(runs, resolve)
    lines = str(error.value).splitlines()
    assert lines[0] == "2 of 3 sweep runs have invalid configs, so none ran:"
    assert lines[1].startswith("  lr=-1: ") and lines[1].endswith("config key 'learner': lr=-1.0 must be > 0")
    assert lines[2].startswith("  lr=-2: ")
    assert not (tmp_path / "out").exists()
    # The same error in every run is reported once, with the runs' names.
    spec_path = _sweep(tmp_path, f"""
        base: base.yaml
        out_dir: {tmp_path / "out"}
        grid: {{group_size: [4, 8]}}
        set: {{steps: many}}
    """, name="t.yaml")
    with pytest.raises(ConfigError, match=r"2 of 2 .*\n  group_size=4, group_size=8: .*'steps': expected an int"):
        write_configs(expand(spec_path)[1], resolve)


TRAIN_SCRIPT = """
import json, pathlib, sys, yaml
config = yaml.safe_load(open(sys.argv[1]))
print("training in", config["run_dir"], flush=True)
if config["fail"]:
    sys.exit(3)
run = pathlib.Path(config["run_dir"])
with open(run / "metrics.jsonl", "w") as f:
    for step in range(1, config["steps"] + 1):
        f.write(json.dumps({"step": step, "reward/mean": config["learner"]["lr"] * 1000 * step, "kl": 0.01}) + "\\n")
"""


def test_run_sweep_trains_each_run_goes_on_after_a_failure_and_compares(tmp_path, capfd):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    out = tmp_path / "out"
    path = _sweep(tmp_path, f"""
        base: base.yaml
        out_dir: {out}
        runs:
          - {{learner.lr: 1e-4}}
          - {{learner.lr: 2e-4, fail: true}}
          - {{learner.lr: 3e-4}}
    """)
    code = run_sweep(path, resolve, dry_run=False, train_command=[sys.executable, str(script)])
    captured = capfd.readouterr()
    assert code == 1
    assert captured.out.count("training in") == 3  # the failed run did not stop the sweep
    assert "lr=0.0002_fail=true failed (exit code 3); going on" in captured.err
    assert "1 of 3 runs failed: lr=0.0002_fail=true" in captured.err
    table = {line.split()[0]: line.split()[1:] for line in captured.out.splitlines()
             if line.startswith("lr=")}
    assert table == {"lr=0.0001": ["3", "0.3", "0.3", "0.01"],
                     "lr=0.0002_fail=true": ["-", "-", "-", "-"],
                     "lr=0.0003": ["3", "0.9", "0.9", "0.01"]}
    assert (out / "compare_reward.png").stat().st_size > 10_000
    assert "\n| lr=0.0003           |     3 |         0.9 |" in (out / "summary.md").read_text()


def test_run_sweep_records_a_command_that_cannot_start(tmp_path, capfd):
    path = _sweep(tmp_path, f"base: base.yaml\nout_dir: {tmp_path / 'out'}\ngrid: {{steps: [1]}}\n")
    assert run_sweep(path, resolve, dry_run=False, train_command=[str(tmp_path / "no-such-trainer")]) == 1
    assert "cannot start" in capfd.readouterr().err


SLOW_TRAIN_SCRIPT = """
import pathlib, signal, sys, time, yaml
run = pathlib.Path(yaml.safe_load(open(sys.argv[1]))["run_dir"])
def stop(*_):
    time.sleep(0.3)  # as a trainer stopping its bridge would
    (run / "stopped").write_text("cleanly")
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
(run / "started").write_text("")
time.sleep(60)
"""

# A shell starts a background job with SIGINT ignored, and Python then leaves it ignored: Ctrl-C as a
# terminal's foreground sweep gets it, whoever started the tests.
SWEEP_DRIVER = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from jaxrl.run.sweep import run_sweep
from jaxrl.run.typed_config import apply_overrides, read_yaml
sys.exit(run_sweep(sys.argv[1], lambda base, o: apply_overrides(read_yaml(base), o), False,
                   [sys.executable, sys.argv[2]]))
"""


def test_ctrl_c_lets_the_current_run_shut_down_and_starts_no_other(tmp_path):
    import os
    import signal
    import subprocess
    import time

    (tmp_path / "train.py").write_text(SLOW_TRAIN_SCRIPT)
    (tmp_path / "driver.py").write_text(SWEEP_DRIVER)
    out = tmp_path / "out"
    path = _sweep(tmp_path, f"base: base.yaml\nout_dir: {out}\ngrid: {{steps: [1, 2]}}\n")
    proc = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(path), str(tmp_path / "train.py")],
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out / "steps=1" / "started").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal reaches the whole foreground group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert (out / "steps=1" / "stopped").read_text() == "cleanly"
    assert not (out / "steps=2" / "started").exists()
    assert "interrupted: stopping steps=1 at a checkpoint; the queued runs do not start" in err
    assert "interrupted; these runs did not start: steps=2" in err
