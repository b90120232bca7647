"""Reproducible runs: a run killed outright and resumed, replayed with `jaxrl train --replay`,
comes out the same step by step; and how a replay compares metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from jaxrl.run.replay import Comparison, ReplayError, compare, compared, replay_config
from jaxrl.run.tracking import read_metrics
from jaxrl.tiny import build_tiny_model
from test_train import ROOT, jaxrl, summary_of, write_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", "qwen3")


def test_a_run_killed_and_resumed_is_what_its_replay_trains(model_dir, tmp_path):
    """The replay is a second uninterrupted run of the same config and seed: equal metrics at every
    step (timings excepted) and equal completions, both before the kill and after the resume."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", model_dir, run_dir, steps=5, checkpoint_every=2,
                          rewards=[{"fn": "env"}, {"fn": "tests.workers.rewards:even_length"}],
                          eval={"episodes": 4, "temperature": 1.0, "before": False},  # sampled: seeded too
                          log={"progress": False, "tensorboard": False})
    stderr = tmp_path / "killed.stderr"
    with open(stderr, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "jaxrl.run.cli", "train", str(config)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:  # killed once it logged a step past its last checkpoint: the resumed run trains that step again
        deadline = time.monotonic() + 300
        while not _logged_past_a_checkpoint(run_dir):
            assert proc.poll() is None, stderr.read_text()[-3000:]
            assert time.monotonic() < deadline, "no step logged past a checkpoint"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = max(r["step"] for r in read_metrics(run_dir))

    resumed = jaxrl("train", config, "--resume")
    assert summary_of(resumed)["steps"] == 5
    start = int(re.search(r"resumed from step (\d+)", resumed.stdout).group(1))
    assert start < killed_at  # steps logged before the kill were trained again
    assert all(r["grad_norm"] > 0 for r in read_metrics(run_dir) if "grad_norm" in r)  # updates that move
    sessions = json.loads((run_dir / "run.json").read_text())["sessions"]
    assert [s["start_step"] for s in sessions] == [0, start]

    replay = jaxrl("train", "--replay", run_dir)
    assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-3000:]
    assert "replay matched 5 steps" in replay.stdout.splitlines() and "warning" not in replay.stderr
    assert json.loads(replay.stdout.splitlines()[-1])["replay"] == {"matched": True, "steps": 5}
    samples = [[json.loads(line) for line in (run_dir / d / "samples.jsonl").read_text().splitlines()]
               for d in (".", "replay")]
    assert samples[0] == samples[1] and len(samples[0]) == 5 * 2  # the same completions, token for token
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2, 3, 4, 5]

    again = jaxrl("train", "--replay", run_dir)
    assert again.returncode == 2 and "holds an earlier replay" in again.stderr


def _logged_past_a_checkpoint(run_dir) -> bool:
    """Whether the run logged a step after its last finished checkpoint (Orbax renames it on commit)."""
    directory = run_dir / "checkpoints"
    checkpoints = [int(d) for d in os.listdir(directory) if d.isdigit()] if directory.is_dir() else []
    if not checkpoints or not (run_dir / "metrics.jsonl").exists():
        return False
    return max([r["step"] for r in read_metrics(run_dir)], default=0) > max(checkpoints)


ROWS = [{"step": 1, "time": 1.0, "loss": 0.5, "time/step_s": 2.0, "compiles/bridge": 3.0},
        {"step": 2, "time": 2.0, "loss": 0.25, "tokens_per_s": 9.0},
        {"step": 2, "time": 3.0, "eval/success": 0.5}]  # the final evaluation's row


def test_compare_skips_timings_and_names_the_first_difference():
    rerun = [dict(r, time=r["time"] + 7, **{"tokens_per_s": 1.0, "step_s": 4.0}) for r in ROWS]
    assert compare(ROWS, rerun) == Comparison(2) and compare(ROWS, rerun).line() == "replay matched 2 steps"
    assert not compared("time/env_s") and not compared("compiles/learner") and compared("timeouts")
    assert not compared("env/echo/pool_wait_s") and compared("env/echo/reward")
    survived = [dict(r, **{"bridges/deaths": 1.0, "bridges/restarts": 1.0, "env/echo/restarts": 2.0, "env/echo/retries": 0.5,
                           "groups/re_requested": 3.0, "rollout/episodes_retried": 4.0, "rollout/requests": 9.0})
                for r in ROWS]
    assert compare(survived, ROWS).matched  # faults the run survived are the machine's, not the run's
    changed = [ROWS[0], dict(ROWS[1], loss=0.3), ROWS[2]]
    result = compare(ROWS, changed)
    assert not result.matched and (result.step, result.key, result.recorded, result.replayed) == (2, "loss", 0.25, 0.3)
    assert result.line() == "replay differs at step 2 (after 1 matching): loss: recorded 0.25, replayed 0.3"
    assert compare(ROWS, ROWS[:2]).line().endswith("eval/success: recorded 0.5, replayed '(absent)'")
    assert compare(ROWS, ROWS[:1]).line() == "replay differs at step 2 (after 1 matching): step: recorded 'logged', replayed '(absent)'"
    assert compare(ROWS[:1], ROWS).matched  # steps the run did not reach are not compared


def test_what_cannot_be_replayed_is_refused(model_dir, tmp_path):
    with pytest.raises(ReplayError, match="not a run directory"):
        replay_config(tmp_path, [])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_config(run_dir / "config.yaml", model_dir, run_dir)
    with pytest.raises(ReplayError, match="logged no step"):
        replay_config(run_dir, [])
    (run_dir / "metrics.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    cfg = replay_config(run_dir, ["steps=2"])
    assert (cfg.run_dir, cfg.steps) == (str(run_dir / "replay"), 2)
    assert replay_config(run_dir, [f"run_dir={tmp_path / 'elsewhere'}"]).run_dir == str(tmp_path / "elsewhere")
    (run_dir / "replay").mkdir()
    replay_config(run_dir, [])  # an empty directory is no earlier replay
    (run_dir / "replay" / "metrics.jsonl").write_text("")
    with pytest.raises(ReplayError, match="holds an earlier replay"):
        replay_config(run_dir, [])
