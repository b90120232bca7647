"""Sweep launchers: shares of the machine, local runs in parallel with their state and Ctrl-C, and a
real one-node SLURM cluster (scripts/setup_slurm.sh) running a sweep, a run cancelled and requeued."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jaxrl.run.launchers import Slot, error_line, read_state, run_train, slots, slurm_states, visible_gpus
from jaxrl.run.sweep import report, run_sweep, status, status_table
from jaxrl.run.tracking import read_metrics
from jaxrl.run.typed_config import ConfigError, apply_overrides, read_yaml

ROOT = Path(__file__).resolve().parents[1]


def test_slots_split_cpus_and_gpus_evenly_and_disjointly():
    assert slots(2, [0, 1, 2, 3], []) == [Slot((0, 1), None), Slot((2, 3), None)]
    assert slots(3, range(4), ["0", "1", "2"]) == [Slot((0,), ("0",)), Slot((1,), ("1",)), Slot((2, 3), ("2",))]
    assert slots(3, [0, 1], []) == [Slot((0,), None), Slot((1,), None), Slot((0,), None)]  # more runs than CPUs
    with pytest.raises(ConfigError, match=r"parallel: 4 runs at once need at least 4 GPUs; this machine has 2"):
        slots(4, range(8), ["0", "1"])
    slot = Slot((2, 3), ("1",))
    assert slot.environ({"A": "b"}) == {"A": "b", "CUDA_VISIBLE_DEVICES": "1"}
    if shutil.which("taskset"):
        assert slot.command(["jaxrl", "train"]) == ["taskset", "-c", "2,3", "jaxrl", "train"]


def test_visible_gpus(tmp_path):
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert visible_gpus({}, tmp_path) == ["0", "1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3,5"}, tmp_path) == ["3", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, tmp_path) == []


def test_run_train_records_the_state_and_the_error_line(tmp_path):
    script = "import sys; print('step 1'); print('jaxrl train: error: bridge down', file=sys.stderr); print('bye')"
    assert run_train([sys.executable, "-c", script + "; sys.exit(1)"], tmp_path, stream=False) == 1
    state = read_state(tmp_path)
    assert state["state"] == "failed" and state["exit_code"] == 1 and state["error"] == "jaxrl train: error: bridge down"
    assert (tmp_path / "logs" / "console.log").read_text().splitlines()[0] == "step 1"
    assert run_train([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"], tmp_path,
                     stream=False) == -signal.SIGTERM
    assert read_state(tmp_path)["state"] == "stopped"
    assert run_train([str(tmp_path / "nope")], tmp_path, stream=False) == 127
    state = read_state(tmp_path)  # the error of this session, not of the earlier one in the same log
    assert state["state"] == "failed" and state["error"].startswith("cannot start")
    assert error_line(tmp_path / "logs" / "console.log") == "jaxrl train: error: bridge down"


FAKE_TRAIN = """
import json, os, pathlib, sys, time, yaml
config = yaml.safe_load(open(sys.argv[1]))
run = pathlib.Path(config["run_dir"])
began = time.time()
for step in range(1, config["steps"] + 1):
    time.sleep(0.3)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "reward/mean": config["lr"] * step}) + "\\n")
(run / "ran.json").write_text(json.dumps({"began": began, "ended": time.time(),
                                          "cpus": sorted(os.sched_getaffinity(0))}))
if config["lr"] < 0:
    sys.exit("jaxrl train: error: lr < 0")
"""


def _resolve(base, overrides):
    return apply_overrides(read_yaml(base), overrides)


def test_local_runs_in_parallel_on_their_own_cpus_and_report(tmp_path):
    (tmp_path / "train.py").write_text(FAKE_TRAIN)
    (tmp_path / "base.yaml").write_text("lr: 1\nsteps: 3\n")
    out = tmp_path / "out"
    (tmp_path / "s.yaml").write_text(textwrap.dedent(f"""
        base: base.yaml
        out_dir: {out}
        parallel: 2
        grid: {{lr: [1, 2, -1], steps: [3]}}
    """))
    code = run_sweep(tmp_path / "s.yaml", _resolve, False, [sys.executable, str(tmp_path / "train.py")])
    assert code == 1  # lr=-1 failed
    ran = {d.name: json.loads((d / "ran.json").read_text()) for d in out.iterdir() if (d / "ran.json").exists()}
    assert len(ran) == 3
    assert ran["lr=1"]["began"] < ran["lr=2"]["ended"] and ran["lr=2"]["began"] < ran["lr=1"]["ended"]  # at once
    if len(os.sched_getaffinity(0)) >= 2:
        assert not set(ran["lr=1"]["cpus"]) & set(ran["lr=2"]["cpus"])
    rows = {r.name: r for r in status(out)}
    assert [rows[n].state for n in ("lr=1", "lr=2", "lr=-1")] == ["done", "done", "failed"]
    assert (rows["lr=1"].step, rows["lr=1"].steps) == (3, 3)
    assert rows["lr=-1"].detail == "exit code 1: jaxrl train: error: lr < 0"
    assert re.search(r"lr=-1\s+failed\s+3/3\s+exit code 1", status_table(list(rows.values())))
    assert re.search(r"^lr=2 +3 +6 +6$", report(out), re.M) and (out / "summary.md").exists()


def test_status_of_a_queued_and_a_running_run(tmp_path):
    (tmp_path / "train.py").write_text(FAKE_TRAIN)
    (tmp_path / "base.yaml").write_text("lr: 1\nsteps: 40\n")
    out = tmp_path / "out"
    (tmp_path / "s.yaml").write_text(f"base: base.yaml\nout_dir: {out}\ngrid: {{lr: [1, 2]}}\n")
    # SIGINT handled as in a terminal's foreground, even when the tests run as a background job.
    driver = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
              "from jaxrl.run.sweep import run_sweep; from jaxrl.run.typed_config import apply_overrides, "
              "read_yaml; sys.exit(run_sweep(sys.argv[1], lambda b, o: apply_overrides(read_yaml(b), o), False, "
              "[sys.executable, sys.argv[2]]))")
    proc = subprocess.Popen([sys.executable, "-c", driver, str(tmp_path / "s.yaml"), str(tmp_path / "train.py")],
                            cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (out / "lr=1" / "metrics.jsonl").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        rows = status(out)
        assert [r.state for r in rows] == ["running", "queued"] and rows[0].steps == 40
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=60)
        assert proc.returncode == 130
        assert [r.state for r in status(out)] == ["stopped", "queued"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


# ---- a real SLURM cluster ---------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm_cluster():
    """The one-node cluster of scripts/setup_slurm.sh; the daemons it started are stopped at the end."""
    if shutil.which("sinfo") is None and (os.geteuid() != 0 or shutil.which("apt-get") is None):
        pytest.skip("no SLURM on this machine, and installing it needs root and apt-get")
    began = time.monotonic()
    setup = subprocess.run(["bash", "scripts/setup_slurm.sh"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert setup.returncode == 0, setup.stderr[-3000:]
    print(f"SLURM set-up: {time.monotonic() - began:.1f} s")
    started = [int(item.split("=")[1]) for item in setup.stdout.strip().splitlines()[-1].split()[1:]]
    yield
    for pid in reversed(started):  # slurmd, slurmctld, munged
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from jaxrl.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", "qwen3")


def _jaxrl(*args, **kw):
    return subprocess.run([sys.executable, "-m", "jaxrl.run.cli", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, **kw)


def _finished_checkpoints(run_dir: Path) -> list[int]:
    directory = run_dir / "checkpoints"
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


# The long run's steps: enough that it is cancelled mid-way (right after its first checkpoint, at step 5:
# it was at step 7 or 8 when cancelled on a quiet machine, ~0.4 s a step), and no more: it trains them all
# once resumed (80 took ~30 s of that).
LONG = 40


def test_a_slurm_sweep_trains_and_a_cancelled_requeued_run_resumes(slurm_cluster, model_dir, tmp_path):
    (tmp_path / "base.yaml").write_text(textwrap.dedent(f"""
        run_dir: unused
        model: {{dir: {model_dir}}}
        envs: [{{name: echo, bundled: echo, max_concurrent_envs: 16}}]
        rollout: {{groups_per_step: 2, max_tokens: 12, max_total_tokens: 24, max_prompt_tokens: 64}}
        learner: {{group_size: 4, optimizer: {{learning_rate: 1.0e-3}}}}
        eval: {{episodes: 0, before: false}}
        checkpoint_every: 5
        log: {{progress: false, tensorboard: false}}
    """))
    out = tmp_path / "out"
    (tmp_path / "sweep.yaml").write_text(textwrap.dedent(f"""
        base: base.yaml
        out_dir: {out}
        launcher: slurm
        grid: {{steps: [3, {LONG}]}}
        slurm: {{cpus_per_task: 1, time_min: 10, sbatch: {{comment: jaxrl-test}}}}
    """))
    submitted = _jaxrl("sweep", tmp_path / "sweep.yaml", "--no-wait")
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    jobs = [r["job_id"] for r in json.loads((out / "sweep.json").read_text())["runs"]]
    (script,) = (out / "slurm").glob("*/*_submission.sh")  # one job array
    assert "#SBATCH --comment=jaxrl-test" in script.read_text()
    long_run = out / f"steps={LONG}"
    try:
        deadline = time.monotonic() + 180
        while not _finished_checkpoints(long_run) or not read_metrics(long_run):
            assert time.monotonic() < deadline, _jaxrl("sweep", "status", out).stdout
            time.sleep(0.05)
        subprocess.run(["scancel", jobs[1]], check=True)  # cancelled mid-way
        while slurm_states([jobs[1]]):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        cancelled_at = read_metrics(long_run)[-1]["step"]
        assert 0 < cancelled_at < LONG and read_state(long_run)["state"] == "stopped"
        # Requeued; SLURM holds a requeued job for a while before it may start again: start it now.
        subprocess.run(["scontrol", "requeue", jobs[1]], check=True)
        subprocess.run(["scontrol", "update", f"jobid={jobs[1]}", "StartTime=now"], check=True)
        while any(r.state != "done" for r in status(out)):
            rows = status(out)
            assert time.monotonic() < deadline + 120 and not any(r.state in ("failed", "stopped") and r.name !=
                                                                 f"steps={LONG}" for r in rows), status_table(rows)
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", *jobs], check=False)
    shown = _jaxrl("sweep", "status", out)
    assert re.search(r"steps=3\s+done\s+3/3", shown.stdout)
    assert re.search(rf"steps={LONG}\s+done\s+{LONG}/{LONG}", shown.stdout)
    for run, steps in (("steps=3", 3), (f"steps={LONG}", LONG)):
        assert [r["step"] for r in read_metrics(out / run) if "loss" in r] == list(range(1, steps + 1))
    resumed = int(re.search(r"resumed from step (\d+)", (long_run / "logs" / "console.log").read_text()).group(1))
    assert 5 <= resumed <= cancelled_at
    sessions = json.loads((long_run / "run.json").read_text())["sessions"]
    assert [s["start_step"] for s in sessions] == [0, resumed]
    reported = _jaxrl("sweep", "report", out)
    assert reported.returncode == 0 and f"steps={LONG}     {LONG}" in reported.stdout and (out / "summary.md").exists()
