"""`jaxrl train` end to end with real processes (bridge, environment servers), resume, signals,
sweeps, and bad configs that fail in one line before any heavy work."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from object_store import s3_server
from primed import primed_judge
from processes import error_line, gone
from jaxrl.run.run_dir import SHM, SHM_PREFIX
from jaxrl.snapshots import snapshot_versions
from jaxrl.tiny import build_tiny_model
from jaxrl.run.tracking import read_metrics

ROOT = Path(__file__).parents[1]
WORKER = Path(__file__).parent / "workers" / "custom_env_server.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", "qwen3")


def write_config(path: Path, model_dir: Path, run_dir: Path, **sections) -> Path:
    cfg = {
        "run_dir": str(run_dir),
        "model": {"dir": str(model_dir)},
        "envs": [{"name": "echo", "bundled": "echo", "max_concurrent_envs": 16}],
        "steps": 3,
        "rollout": {"groups_per_step": 2, "max_tokens": 12, "max_total_tokens": 24, "max_prompt_tokens": 64},
        "learner": {"group_size": 4, "optimizer": {"learning_rate": 1e-3}},
        "eval": {"episodes": 8},
        "checkpoint_every": 2,
        "log": {"progress": False},
    }
    cfg.update(sections)
    path.write_text(yaml.safe_dump(cfg))
    return path


def jaxrl(*args, timeout=600, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxrl.run.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, **kwargs)


def summary_of(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_distillation_run_scores_every_episode_with_its_teacher(model_dir, tmp_path):
    # The teacher is the student's own starting model: at step 1 the reverse KL is 0 up to rounding,
    # and the student moves away from it only as the teacher's advantages pull it (distillation alone).
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", model_dir, run_dir, teacher={"model": str(model_dir)},
                          learner={"group_size": 4, "optimizer": {"learning_rate": 1e-3},
                                   "loss": {"loss_type": "dapo", "distill_weight": 1.0, "task_weight": 0.0}})
    summary = summary_of(jaxrl("train", config))
    assert summary["steps"] == 3 and summary["programs_after_first_step"] == 0
    rows = [r for r in read_metrics(run_dir) if "distill_reverse_kl" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert abs(rows[0]["distill_reverse_kl"]) < 1e-4 and rows[0]["advantage_mean"] == pytest.approx(0, abs=1e-4)
    assert abs(rows[-1]["distill_reverse_kl"]) > abs(rows[0]["distill_reverse_kl"])


def test_train_runs_end_to_end_then_resumes(model_dir, tmp_path):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", model_dir, run_dir, eval={"episodes": 16},
                          rewards=[{"fn": "env"}, {"fn": "tests.workers.rewards:short", "weight": 0.5}])
    summary = summary_of(jaxrl("train", config))
    assert summary["steps"] == 3 and summary["run_dir"] == str(run_dir)
    # Compiled or loaded from the cache, no program is new after step 1: step 2's checkpoint included
    # (16 when it sliced the norms).
    assert summary["programs_after_first_step"] == 0
    for key in ("wall_s", "eval_before", "eval_after", "eval_stderr"):
        assert isinstance(summary[key], float), key
    rows = read_metrics(run_dir)
    steps = [r["step"] for r in rows if "reward/mean" in r]
    assert steps == [1, 2, 3]
    for key in ("loss", "entropy", "grad_norm", "env/echo/reward", "time/generate_s", "time/learn_s", "time/sync_s"):
        assert key in rows[0], key
    for r in rows[:2]:  # sync mode: each step's engine work is its own episodes' (the third's has the evaluation's)
        assert r["engine/tokens"] >= r["completion/model_tokens"] * r["rollout/episodes"] > 0, r
        assert r["engine/decode_calls"] >= 1 and r["engine/insert_calls"] >= 1, r
        assert 0 < r["engine/insert_s"] < r["engine/device_s"] < r["engine/busy_s"] <= r["time/rollout_s"], r
    assert (run_dir / "checkpoints" / "3").is_dir()
    bridge_log = (run_dir / "logs" / "bridge.log").read_text()
    assert "serving snapshot" in bridge_log and "version 4" in bridge_log  # the weights after 3 updates
    _assert_snapshots_lived_in_memory(bridge_log)
    assert snapshot_versions(run_dir / "snapshots") == [4]  # the one served at the end, for eval and export
    for png in ("reward.png", "metrics.png"):
        assert (run_dir / "plots" / png).stat().st_size > 1000
    assert list((run_dir / "tensorboard").iterdir())
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["steps"] == 3
    assert (run_dir / "samples.jsonl").read_text().count("\n") == 3 * 2

    refused = jaxrl("train", config, "--set", "steps=5")  # a finished run is not overwritten
    assert refused.returncode == 2 and "--resume" in refused.stderr

    # `jaxrl eval` of the finished run is the run's own final evaluation, to the last digit.
    final = [r for r in rows if "eval/success" in r][-1]
    evaluated = summary_of(jaxrl("eval", run_dir))
    assert evaluated["weights"] == "snapshot 4" and evaluated["tasks"] == 16
    assert (evaluated["success"], evaluated["reward"]) == (summary["eval_after"], final["eval/reward/mean"])
    assert summary_of(jaxrl("eval", run_dir, "--env", "echo", "--episodes", 4))["tasks"] == 4
    refused = jaxrl("eval", run_dir, "--max-tokens", 0)
    assert refused.returncode == 2 and "rollout" in error_line(refused.stderr, "jaxrl eval")

    summary = summary_of(jaxrl("train", config, "--set", "steps=5", "--resume"))
    assert summary["steps"] == 5 and summary["eval_before"] is not None
    _assert_snapshots_lived_in_memory((run_dir / "logs" / "bridge.log").read_text())
    assert snapshot_versions(run_dir / "snapshots") == [4, 6]
    rows = [r for r in read_metrics(run_dir) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    # A second process on the same shapes loads the learner's executables from the persistent cache
    # at its first step (step 4), and needs none after it.
    assert [r["compiles/learner"] for r in rows[3:]] == [0.0, 0.0] and rows[3]["programs/learner"] > 0
    assert summary["programs_after_first_step"] == 0
    assert (run_dir / "checkpoints" / "5").is_dir()


def test_the_default_config_trains_and_its_console_says_only_jaxrls_things(tmp_path):
    """configs/tiny_cpu.yaml as the README runs it, shortened (a warm start, two steps, a small evaluation):
    every stderr line is jaxrl's own (its lines, the progress bar); libraries' notices (transformers' "PyTorch
    was not found" where torch is absent: tests/test_tracking.py) go to logs/train.log. On one CPU device as
    a user's machine has, not conftest's 8: XLA's C++ log writes straight to stderr while it compiles (on 8
    devices, the SPMD partitioner's "Involuntary full rematerialization" warnings)."""
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "").replace(
        "--xla_force_host_platform_device_count=8", "")}
    proc = jaxrl("train", "configs/tiny_cpu.yaml", *[a for kv in [
        f"run_dir={tmp_path / 'run'}", f"model.dir={tmp_path / 'model'}", "steps=2", "rollout.groups_per_step=2",
        "learner.group_size=4", "sft.steps=2", "sft.demonstrations=16", "sft.batch_size=8", "eval.episodes=4"]
        for a in ("--set", kv)], env=env)
    summary = summary_of(proc)
    assert summary["steps"] == 2
    # The last line carries what the README quotes: success before, after the warm start and after RL, each with
    # its standard error, and what RL added with the standard error of that difference.
    for key in ("eval_before", "eval_after_warm_start", "eval_after"):
        p = summary[key]
        assert summary[f"{key}_stderr"] == pytest.approx(math.sqrt(p * (1 - p) / 4)), key
    assert summary["rl_gain"] == pytest.approx(summary["eval_after"] - summary["eval_after_warm_start"])
    assert summary["rl_gain_stderr"] == pytest.approx(math.hypot(summary["eval_after_stderr"],
                                                                 summary["eval_after_warm_start_stderr"]))
    assert f"RL added {summary['rl_gain']:+.3f} +- {summary['rl_gain_stderr']:.3f}" in proc.stdout
    lines = [line for line in re.split(r"[\r\n]", proc.stderr) if line.strip()]
    bar = re.compile(r"^\s*\d+%\|")  # the progress bar's redrawn lines
    assert lines and [line for line in lines if not line.startswith("jaxrl") and not bar.match(line)] == []


def test_an_environment_with_a_long_first_prompt_trains_with_the_prompt_budget_sized_from_it(model_dir, tmp_path):
    """No rollout.max_prompt_tokens: the run sizes it from the environment's first prompt, longer than the 64
    of configs/tiny_cpu.yaml's echo (OpenEnv's catalogue environments' first prompts take 179-1,352 tokens)."""
    config = write_config(tmp_path / "c.yaml", model_dir, tmp_path / "run", steps=1, eval={"episodes": 0},
                          envs=[{"name": "brief", "env_class": "tests.workers.trl_env:LongBrief"}],
                          rollout={"groups_per_step": 2, "max_tokens": 8, "max_total_tokens": 16})
    proc = jaxrl("train", config)
    assert summary_of(proc)["steps"] == 1
    [said] = [line for line in proc.stderr.splitlines() if "rollout.max_prompt_tokens sized to" in line]
    budget, tokens = map(int, re.fullmatch(r"jaxrl: rollout.max_prompt_tokens sized to (\d+): environment 'brief''s "
                                           r"first prompt has (\d+) tokens \(set the key to fix it\)", said).groups())
    assert tokens > 128 and budget >= tokens and budget % 64 == 0


@pytest.mark.timeout(600)
def test_the_moe_config_trains_with_routing_replay_and_exports_what_transformers_loads(tmp_path):
    """configs/tiny_moe_cpu.yaml shortened: the engine records routes, the learner replays them (the same
    weights: its logprobs are the engine's), nothing compiles after the first step, and the export's
    logits in transformers are jaxrl's."""
    import numpy as np
    import torch
    import transformers

    from jaxrl.models import load_pretrained

    run_dir = tmp_path / "run"
    summary = summary_of(jaxrl("train", "configs/tiny_moe_cpu.yaml", *[a for kv in [
        f"run_dir={run_dir}", f"model.dir={tmp_path / 'model'}", "steps=3", "rollout.groups_per_step=2",
        "learner.group_size=4", "sft.steps=2", "sft.demonstrations=16", "sft.batch_size=8", "eval.episodes=4",
        "log.progress=false"] for a in ("--set", kv)]))
    assert summary["steps"] == 3 and summary["programs_after_first_step"] == 0
    rows = [r for r in read_metrics(run_dir) if "moe/route_mismatch" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # sync mode: every episode sampled with the weights it trains
        assert r["moe/logp_gap_replay"] < 1e-4 and r["moe/logp_gap_own_routes"] < 1e-3
        assert r["moe/route_mismatch"] < 0.05 and r["loss/router_aux"] > 0
    out = tmp_path / "hf"
    assert jaxrl("export", run_dir, "--out", out).returncode == 0
    ids = np.array([[3, 17, 250, 9, 101, 42, 7, 99]])
    ours, _ = load_pretrained(out)(ids, np.arange(8)[None], np.ones((1, 8), np.int32))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        np.testing.assert_allclose(hf(torch.tensor(ids)).logits.numpy(), np.asarray(ours), atol=1e-4)


@pytest.mark.timeout(900)  # two runs, an evaluation and an export: ~3 minutes on a quiet machine
def test_a_lora_run_warm_starts_publishes_adapters_evaluates_resumes_streaming_and_exports(model_dir, tmp_path):
    import peft  # noqa: F401  (the export's reader; the test extra has it)

    from jaxrl.snapshots import SnapshotReader

    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", model_dir, run_dir, steps=3, eval={"episodes": 8},
                          sft={"steps": 2, "batch_size": 8, "demonstrations": 8},
                          learner={"group_size": 4, "optimizer": {"learning_rate": 1e-3},
                                   "loss": {"is_level": "token"}, "lora": {"rank": 4, "alpha": 8}})
    summary = summary_of(jaxrl("train", config))
    assert summary["steps"] == 3 and summary["programs_after_first_step"] == 0
    assert "eval_after_warm_start" in summary
    bridge_log = (run_dir / "logs" / "bridge.log").read_text()
    assert "version 4" in bridge_log
    snapshot = SnapshotReader(run_dir / "snapshots").load(4)
    assert snapshot.adapter_config["r"] == 4 and snapshot.adapter_config["base_model_name_or_path"] == str(model_dir)
    assert all(".lora_A." in name or ".lora_B." in name for name in snapshot.tensors)
    evaluated = summary_of(jaxrl("eval", run_dir))
    assert evaluated["weights"] == "snapshot 4" and evaluated["success"] == summary["eval_after"]

    # Resumed in stream mode: episodes under way take each new adapter version.
    summary = summary_of(jaxrl("train", config, "--set", "steps=5", "--set", "rollout.mode=stream", "--resume"))
    assert summary["steps"] == 5
    assert [r["step"] for r in read_metrics(run_dir) if "reward/mean" in r] == [1, 2, 3, 4, 5]
    assert "version 6" in (run_dir / "logs" / "bridge.log").read_text()
    out = jaxrl("export", run_dir, "--out", tmp_path / "adapters")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "adapters" / "adapter_model.safetensors").is_file()


@pytest.mark.timeout(900)  # a run killed at step 3, resumed, evaluated and exported: 75 s on a loaded machine
def test_a_lora_run_over_a_warm_start_of_every_weight_serves_restarts_resumes_and_exports(model_dir, tmp_path):
    """sft.train_all: the warm start trains every weight, written to RUN/base-model; the bridges
    (restarted on it, and again after a SIGKILL) serve the adapters over it with the learner's own
    logprobs; SIGKILLed, the run resumes to the same step and adapters; `jaxrl eval` and export
    --merged take the same base."""
    import numpy as np
    from flax import nnx

    from jaxrl.models import load_pretrained
    from jaxrl.models.hf import read_safetensors
    from jaxrl.models.lora import LoraConfig, add_lora, with_adapters
    from jaxrl.run.export import export
    from jaxrl.run.replay import compared
    from jaxrl.snapshots import SnapshotReader

    run_dir, snapshots = tmp_path / "run", tmp_path / "snapshots"  # on disk: the killed run's are read after it
    config = write_config(tmp_path / "c.yaml", model_dir, run_dir, steps=10_000, checkpoint_every=2,
                          eval={"episodes": 8}, snapshot_dir=str(snapshots),
                          rewards=[{"fn": "env"}, {"fn": "tests.workers.rewards:even_length"}],
                          sft={"steps": 4, "batch_size": 8, "demonstrations": 8, "train_all": True},
                          learner={"group_size": 4, "optimizer": {"learning_rate": 1e-2},
                                   "loss": {"is_level": "token"}, "lora": {"rank": 4, "alpha": 8}})
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl.run.cli", "train", str(config)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _logged_steps(proc, run_dir, 0)
        [bridge] = [c for c in _children_of(proc.pid)  # the one restarted on RUN/base-model
                    if Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0")[3] == b"serve"]
        os.kill(bridge, signal.SIGKILL)  # restarted by the run, on RUN/base-model again
        killed_at = _logged_steps(proc, run_dir, 2)
        # Killed after an odd step, past the bridge's restart, once the step before is checkpointed (every
        # 2, in the background): the last step is taken again.
        while (killed_at % 2 == 0 or not read_metrics(run_dir)[-1]["bridges/restarts"]
               or not (run_dir / "checkpoints" / str(killed_at - 1)).is_dir()):
            killed_at = _logged_steps(proc, run_dir, killed_at)
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    base = run_dir / "base-model"
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in base.iterdir()}
    warm, random = read_safetensors(base), read_safetensors(model_dir)
    assert all(np.abs(np.asarray(warm[k]) - np.asarray(random[k])).max() > 0 for k in warm)  # every weight trained
    rows = read_metrics(run_dir)
    assert rows[-1]["bridges/restarts"] == 1
    models = re.findall(r"jax engine on model (\S+) \(LoRA", (run_dir / "logs" / "bridge.log").read_text())
    assert models == [str(model_dir), str(base), str(base)]  # started, relaunched, restarted
    # The bridges' logprobs (adapters over the warm-started base, before and after the restart) are the
    # learner's own: importance weights of 1 in sync mode.
    for r in rows:
        assert abs(r["is_weight_raw_min"] - 1) < 1e-5 and abs(r["is_weight_raw_max"] - 1) < 1e-5, r
    # No program new after step 1, compiled or loaded, the restarted bridge's warm-up aside.
    assert [r["programs/learner"] + r["programs/bridge"] for r in rows[1:]] == [0.0] * (len(rows) - 1)
    again = killed_at  # the step the resumed run takes again
    first = next(r for r in rows if r["step"] == again)
    published = SnapshotReader(snapshots).load(again + 1)

    resumed = jaxrl("train", config, "--resume", "--set", f"steps={again}")
    summary = summary_of(resumed)
    assert summary["steps"] == again and f"resumed from step {again - 1}\n" in resumed.stdout
    rows = read_metrics(run_dir)
    second = next(r for r in rows if r["step"] == again and "loss" in r)
    # The step taken again samples its episodes again: the same tokens and rewards, but logprobs that
    # may differ in their last bits with the engine's batch and cache shapes, which follow timing
    # (docs/reliability.md, "Reproducibility"), and with is_level set the loss reads them. So: equal to rounding.
    before, after = ({k: v for k, v in r.items() if compared(k)} for r in (first, second))
    assert first["grad_norm"] > 0 and before.keys() == after.keys()
    assert {k: v for k, v in after.items() if v != pytest.approx(before[k], rel=1e-5, abs=1e-6)} == {}
    assert {k: after[k] for k in after if k.startswith(("reward", "completion/", "prompt/"))} == {
        k: before[k] for k in before if k.startswith(("reward", "completion/", "prompt/"))}  # the same episodes
    final = SnapshotReader(run_dir / "snapshots").load(again + 1)
    assert final.adapter_config["base_model_name_or_path"] == str(base)
    assert final.tensors.keys() == published.tensors.keys()
    for k in final.tensors:  # a last-bit difference may round a bfloat16 adapter to its neighbour
        rtol = 1e-4 if final.tensors[k].dtype == np.float32 else 2e-2
        np.testing.assert_allclose(final.tensors[k].astype(np.float32), published.tensors[k].astype(np.float32),
                                   rtol=rtol, atol=1e-6, err_msg=k)

    models = re.findall(r"jax engine on model (\S+) \(LoRA", (run_dir / "logs" / "bridge.log").read_text())
    assert models[3:] == [str(base)]  # resumed
    evaluated = summary_of(jaxrl("eval", run_dir))
    assert evaluated["weights"] == f"snapshot {again + 1}" and evaluated["success"] == summary["eval_after"]
    assert re.findall(r"jax engine on model (\S+) \(LoRA", (run_dir / "logs" / "eval" / "bridge.log").read_text()) == [
        str(base)]
    adapters = export(run_dir, tmp_path / "adapters")
    assert json.loads((adapters / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    ours = load_pretrained(base)  # the learner's model: the warm-started base and the final adapters
    lora = LoraConfig(rank=4, alpha=8)
    nnx.update(ours, with_adapters(ours.cfg, lora, final.tensors, nnx.state(add_lora(ours, lora)), "final"))
    merged = load_pretrained(export(run_dir, tmp_path / "merged", merged=True))
    ids = np.arange(40, 64, dtype=np.int32).reshape(2, 12)
    inputs = (ids, np.broadcast_to(np.arange(12), ids.shape), np.ones_like(ids))
    logits = nnx.jit(lambda model: model(*inputs)[0])  # a program per model graph, not an eager compile per op
    np.testing.assert_allclose(logits(merged), logits(ours), atol=1e-4)
    run_dir.rename(tmp_path / "moved")  # the adapters' config names the base where it was: the run's own is used
    moved = load_pretrained(export(tmp_path / "moved", tmp_path / "merged-moved", merged=True))
    np.testing.assert_array_equal(logits(moved), logits(merged))


def _assert_snapshots_lived_in_memory(bridge_log: str) -> None:
    """The bridge loaded every snapshot from a directory of the run's own in /dev/shm, gone now."""
    if not SHM.is_dir():
        return
    loaded = {line.split("serving snapshot ")[1].split(" version")[0]
              for line in bridge_log.splitlines() if "serving snapshot " in line}
    assert loaded and all(Path(p).parent == SHM and Path(p).name.startswith(SHM_PREFIX) for p in loaded), loaded
    assert not [p for p in loaded if Path(p).exists()]


def _children_of(pid: int) -> list[int]:
    """Processes started with `--parent-pid pid` (our bridge and environment servers)."""
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                args = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--parent-pid" in args and args[args.index(b"--parent-pid") + 1] == str(pid).encode():
                out.append(int(p))
    return out


def _foreign_snapshot(model_dir: Path, directory: Path, version: int) -> None:
    """A real snapshot of the run's model shape, perturbed, that the run never published."""
    import jax
    from flax import nnx

    from jaxrl.models import load_pretrained
    from jaxrl.snapshots import SnapshotWriter

    model = load_pretrained(model_dir)
    state = jax.tree.map(lambda x: x + 1.0, nnx.state(model, nnx.Param))
    writer = SnapshotWriter(directory, model.cfg)
    writer.publish(state, version)
    writer.close()


def _probe_the_bridge(pid: int, run_dir: Path, foreign: Path) -> None:
    """Another local client tries to make the run's bridge (`pid`) serve the foreign snapshot: without
    the token, with a wrong one, and with the right one (read from the bridge's environment, as
    its owner can) through the path outside its snapshot root, a `..` path, and an older version."""
    import grpc

    from bridge.client import BridgeClient, BridgeRequestError, BridgeUnauthenticated

    # The root the run publishes under (its launch file is gone): where the bridge loaded step 1's weights.
    root = Path(re.search(r"serving snapshot (\S+) version", (run_dir / "logs" / "bridge.log").read_text())[1])
    environ = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
    token = environ[b"JAXRL_BRIDGE_TOKEN"].decode()
    address = next(line.split()[1] for line in (run_dir / "logs" / "bridge.log").read_text().splitlines()
                   if line.startswith("BRIDGE_LISTENING "))
    for wrong in (None, token[::-1]):
        with BridgeClient(address, timeout_s=10, token=wrong) as intruder:
            with pytest.raises(BridgeUnauthenticated):
                intruder.load_snapshot(foreign, 999)
    with BridgeClient(address, timeout_s=10, token=token) as insider:
        for path, version, code in [(foreign, 999, grpc.StatusCode.PERMISSION_DENIED),
                                    (root / os.path.relpath(foreign, root), 999, grpc.StatusCode.PERMISSION_DENIED),
                                    (root, 0, grpc.StatusCode.FAILED_PRECONDITION)]:
            with pytest.raises(BridgeRequestError) as e:
                insider.load_snapshot(path, version)
            assert e.value.code == code, e.value
        stats = insider.stats()
    assert stats["unauthenticated"] == 2 and stats["snapshot_refusals"] == 1 and stats["policy_version"] < 999


def test_sigterm_stops_cleanly_with_a_checkpoint_and_no_children_left(model_dir, tmp_path):
    """Also the poisoning probe: while the run trains, other clients cannot make its bridge serve
    weights the run did not publish."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", model_dir, run_dir, steps=10_000, checkpoint_every=1000)
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl.run.cli", "train", str(config)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _foreign_snapshot(model_dir, tmp_path / "foreign", 999)  # while the run starts
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or not read_metrics(run_dir):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no step logged"
            time.sleep(0.5)
        children = _children_of(proc.pid)
        assert len(children) == 2  # the bridge and the echo server
        [bridge] = [c for c in children if Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0")[3] == b"serve"]
        _probe_the_bridge(bridge, run_dir, tmp_path / "foreign")
        probed = len(read_metrics(run_dir))
        while len(read_metrics(run_dir)) < probed + 2:  # steps trained after the probe
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no step logged after the probe"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]  # 143: stopped, not finished
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["stopped"] == "SIGTERM" and 1 <= summary["steps"] < 10_000
    assert "eval_after" not in summary  # a stopped run is not evaluated as finished
    assert (run_dir / "checkpoints" / str(summary["steps"])).is_dir()
    assert not [c for c in children if not gone(c)]
    _assert_snapshots_lived_in_memory((run_dir / "logs" / "bridge.log").read_text())
    assert snapshot_versions(run_dir / "snapshots") == [summary["steps"] + 1]
    # Every step trained on trajectories of the weights the run served then (the base model, 0, for
    # step 1, then the version published after the step before), and no group came back foreign or stale.
    rows = [r for r in read_metrics(run_dir) if "rollout/oldest_version" in r]
    assert len(rows) >= 3
    assert not [r for r in rows if r.get("rollout/groups_foreign_version") or r.get("rollout/groups_stale")]
    assert [r["rollout/oldest_version"] for r in rows] == [0.0] + [r["version"] for r in rows[:-1]]


def _logged_steps(proc: subprocess.Popen, run_dir: Path, more_than: int, within_s: float = 300) -> int:
    """Waits until the running `jaxrl train` has logged a step past `more_than`; the last one logged."""
    deadline = time.monotonic() + within_s
    while True:
        steps = [r["step"] for r in read_metrics(run_dir)] if (run_dir / "metrics.jsonl").exists() else []
        if steps and steps[-1] > more_than:
            return steps[-1]
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, f"no step after {more_than} logged"
        time.sleep(0.05)


def test_a_stalled_then_killed_environment_server_costs_replays_and_a_restart_not_the_run(model_dir, tmp_path):
    """Default retry settings. Steps take ~0.1 s here, and none can pass a frozen or dead server: both
    faults land mid-run."""
    run_dir, steps = tmp_path / "run", 12
    config = write_config(tmp_path / "c.yaml", model_dir, run_dir, steps=steps, eval={"episodes": 0},
                          checkpoint_every=1000)
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl.run.cli", "train", str(config)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stalled_at = _logged_steps(proc, run_dir, 0)
        [server] = [c for c in _children_of(proc.pid) if b"env" in Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0")]
        os.kill(server, signal.SIGSTOP)  # hangs: it takes connections (the kernel does) and answers nothing
        try:
            # Past 30 s: a session opened just before the stall is lost to its keepalive pings (10 s + 20 s),
            # not answered late.
            time.sleep(31)
        finally:
            os.kill(server, signal.SIGCONT)
        killed_at = _logged_steps(proc, run_dir, stalled_at, within_s=60)  # the stall cost no step
        assert killed_at <= steps - 3
        os.kill(server, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["steps"] == steps
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    retried = sum(r["rollout/episodes_retried"] for r in rows)
    assert retried >= 8 and any(r.get("env/echo/retries", 0) > 0 for r in rows)  # replayed, then trained on
    assert sum(r["rollout/episodes_failed"] for r in rows) == 0  # none lost for good
    restarts = [r["env/echo/restarts"] for r in rows]
    assert restarts[0] == 0 and restarts[-1] == 1  # the kill, not the stall
    assert "was killed by SIGKILL; restarting it on port" in err
    print(f"stalled after step {stalled_at}, killed after step {killed_at}: {retried:.0f} episodes replayed")


def test_a_streaming_run_trains_on_groups_as_they_complete_never_on_stale_tokens(model_dir, tmp_path):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", model_dir, run_dir, steps=4, eval={"episodes": 0},
                          rollout={"mode": "stream", "in_flight_groups": 3, "max_staleness": 1, "groups_per_step": 2,
                                   "max_tokens": 12, "max_total_tokens": 24, "max_prompt_tokens": 64},
                          learner={"group_size": 4, "loss": {"is_level": "token"}})
    summary = summary_of(jaxrl("train", config))
    assert summary["steps"] == 4 and summary["programs_after_first_step"] == 0
    rows = [r for r in read_metrics(run_dir) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["rollout/staleness_max"] <= 1 and r["rollout/groups_padded"] == 0 for r in rows)
    # Every step trains all the tokens it kept, each of them at most one version behind.
    assert all(r["rollout/trained_tokens"] == r.get("rollout/tokens_lag_0", 0) + r.get("rollout/tokens_lag_1", 0)
               for r in rows)
    assert [r["version"] for r in rows] == [2, 3, 4, 5]


def test_two_environments_async_with_a_test_only_url_environment(model_dir, tmp_path):
    server = subprocess.Popen([sys.executable, str(WORKER), "reverse"], stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().split()[1]
        config = write_config(
            tmp_path / "c.yaml", model_dir, tmp_path / "run",
            envs=[{"name": "echo", "bundled": "echo", "max_concurrent_envs": 16},
                  {"name": "reverse", "url": url, "session": {"connect_timeout_s": 30.0}}],
            rollout={"mode": "async", "groups_per_step": 4, "max_tokens": 12, "max_total_tokens": 24, "max_prompt_tokens": 64},
            learner={"group_size": 2, "loss": {"is_level": "token"}},
        )
        # the test-only server may still be starting: check_startup would refuse it, so wait
        deadline = time.monotonic() + 60
        while jaxrl("config", config).returncode != 0 or not _answers(url):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        summary = summary_of(jaxrl("train", config))
    finally:
        server.terminate()
        server.wait(10)
    assert summary["steps"] == 3
    rows = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    envs_seen = {k.split("/")[1] for r in rows for k in r if k.startswith("env/") and k.endswith("/episodes")}
    assert envs_seen == {"echo", "reverse"}
    assert all("rollout/groups_stale" in r or "rollout/episodes" in r for r in rows)
    assert max(r["version"] for r in rows) == 4


def test_training_through_a_bridge_started_on_its_own(model_dir, tmp_path):
    from bridge.wire import BridgeLaunch, ServerSpec
    from jaxrl.run.processes import EnvServerProcess
    from jaxrl.run.processes import BridgeProcess

    with EnvServerProcess.start("echo", max_concurrent_envs=16) as server:
        envs = tmp_path / "envs.json"
        envs.write_text(json.dumps({"envs": [{"name": "echo", "url": server.url}]}))
        bridge = BridgeProcess.start(BridgeLaunch(model_dir, envs=envs,
                                                  server=ServerSpec(snapshot_roots=[tmp_path / "run" / "snapshots"])))
        try:
            (tmp_path / "token").write_text(bridge.token)
            (tmp_path / "token").chmod(0o600)
            config = write_config(tmp_path / "c.yaml", model_dir, tmp_path / "run", steps=2,
                                  envs=[{"name": "echo", "url": server.url}],
                                  bridge={"addresses": [bridge.address], "token_file": str(tmp_path / "token")})
            summary = summary_of(jaxrl("train", config))
            health = bridge.client.health()
        finally:
            bridge.stop()
    assert summary["steps"] == 2 and "eval_before" in summary
    assert health.policy_version == 3  # the run's own weights after two updates, published to it
    assert snapshot_versions(tmp_path / "run" / "snapshots") == [0, 2, 3]  # where a bridge elsewhere reads them
    assert not (tmp_path / "run" / "logs" / "bridge.log").exists()  # no bridge of its own


def _answers(url: str) -> bool:
    import urllib.request

    try:
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url + "/health", timeout=2)
        return True
    except OSError:
        return False


def test_sweep_of_two_by_two_overrides_dry_runs_four_then_two_run_at_once_and_compare(model_dir, tmp_path):
    """The 2 x 2 grid resolved and written (dry run); then a grid of two real runs, at once: a third run
    waiting for a free slot is test_launchers' (fake trainers), and the grid's product test_sweep's."""
    write_config(tmp_path / "base.yaml", model_dir, tmp_path / "unused", steps=1, eval={"episodes": 0})
    spec = {"base": "base.yaml", "name": "grid", "out_dir": str(tmp_path / "dry"),
            "grid": {"learner.optimizer.learning_rate": [1e-3, 1e-4], "rollout.temperature": [1.0, 0.7]},
            "parallel": 2}  # two at a time, each on its own CPUs
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump(spec))
    dry = jaxrl("sweep", sweep, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert len([line for line in dry.stdout.splitlines() if line.startswith("jaxrl train ")]) == 4
    assert len([p for p in (tmp_path / "dry").iterdir() if (p / "config.yaml").exists()]) == 4
    sweep.write_text(yaml.safe_dump({**spec, "out_dir": str(tmp_path / "sweeps"),
                                     "grid": {"learner.optimizer.learning_rate": [1e-3, 1e-4],
                                              "rollout.temperature": [0.7]}}))
    proc = jaxrl("sweep", sweep, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted(p for p in (tmp_path / "sweeps").iterdir() if (p / "config.yaml").exists())
    assert len(runs) == 2 and all(read_metrics(r) for r in runs)
    assert all(json.loads((r / "launch.json").read_text())["state"] == "done" and (r / "run.json").exists()
               and any((r / "checkpoints").iterdir()) for r in runs)
    table = (tmp_path / "sweeps" / "summary.md").read_text()
    assert all(r.name in table for r in runs) and "reward/mean" in table
    assert (tmp_path / "sweeps" / "compare_reward.png").stat().st_size > 1000


@pytest.mark.parametrize("overrides, message", [
    (["learner.lr=1e-3"], "unknown config key 'learner.lr'"),
    (["steps=many"], "config key 'steps': expected an int"),
    (["envs=[]"], "envs: list at least one environment"),
    (["envs.0.bundled=chess"], "bundled environment 'chess'"),
    (["bridge.addresses=[127.0.0.1:9]"], "bridge.addresses: the bridges' token is needed; set bridge.token_file"),
    (["bridge.addresses=[127.0.0.1:9]", "bridge.token_file={tmp}/token"], "127.0.0.1:9 does not answer"),
    (["envs.0.bundled=null", "envs.0.url=http://127.0.0.1:9"], "environment 'echo'"),
    (["rollout.mode=async"], "learner.loss.is_level"),
    (["model.tiny={hidden_size: 32}"], "differs from model.tiny (hidden_size: 64 != 32"),
    (["learner.temperature=0.5"], "the run derives it from rollout.temperature"),
    (["rewards=[{fn: 'no_such_module:f'}]"], "cannot import module 'no_such_module'"),
    (["learner.group_size=1"], "learner.group_size=1 must be >= 2"),
    (["mesh.data=3"], "mesh: mesh={'data': 3"),
    (["log.wandb={project: p}"], "log.wandb needs the 'wandb' package"),
    (["envs.0.bundled=null", "envs.0.env_class=no_such_module:Env"], "environment 'echo'"),
    (["learner.lora.rank=0"], "learner.lora.rank=0 must be an integer >= 1"),
    (["learner.lora.targets=[q_proj, c_attn]"], "the model has no projection 'c_attn'"),
    (["learner.lora.rank=32", "bridge.engine=vllm", "bridge.engine_kwargs={max_lora_rank: 16}"],
     "bridge.engine_kwargs.max_lora_rank=16 is below learner.lora.rank=32"),
    (["learner.lora.rank=4", "sft.steps=2", "sft.train_all=true", "bridge.addresses=[127.0.0.1:9]"],
     "which bridge.addresses cannot: leave them empty, or set sft.train_all: false"),
])
def test_bad_configs_fail_in_one_line_before_anything_starts(model_dir, tmp_path, overrides, message):
    config = write_config(tmp_path / "c.yaml", model_dir, tmp_path / "run")
    (tmp_path / "token").write_text("a-token")
    (tmp_path / "token").chmod(0o600)
    args = [a for o in overrides for a in ("--set", o.replace("{tmp}", str(tmp_path)))]
    proc = jaxrl("train", config, *args, timeout=120)
    assert proc.returncode == 2
    assert message in error_line(proc.stderr, "jaxrl train")
    assert not (tmp_path / "run").exists()  # nothing started: a run's first act is to make its directory


@pytest.mark.parametrize("fn, last_line", [
    ("nan", "jaxrl train: error: reward function 'nan' (tests.workers.rewards:nan) for episode 0-"),
    ("nothing", "jaxrl train: error: step 2: no reward function scored any episode for 2 steps in a row"),
])
def test_a_run_on_rewards_that_are_not_numbers_stops_in_one_line(model_dir, tmp_path, fn, last_line):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", model_dir, run_dir, steps=5, eval={"episodes": 0},
                          rewards=[{"fn": f"tests.workers.rewards:{fn}"}],
                          rollout={"groups_per_step": 2, "max_tokens": 8, "max_total_tokens": 8,
                                   "max_prompt_tokens": 64, "max_unscored_steps": 2})
    proc = jaxrl("train", config)
    assert proc.returncode == 1, proc.stderr[-3000:]
    error = error_line(proc.stderr, "jaxrl train")
    assert error.startswith(last_line) and f"traceback: {run_dir}/logs/train_error.log" in error, proc.stderr
    if fn == "nothing":  # the step before the stop: warned, and counted
        assert "jaxrl train: WARNING: step 1: no learning signal" in proc.stderr
        assert [r["rollout/no_learning_signal"] for r in read_metrics(run_dir)] == [1.0]
    else:
        assert "returned nan; rewards must be finite" in error
    assert "Traceback" in (run_dir / "logs" / "train_error.log").read_text()


def test_a_run_whose_only_bridge_hangs_for_good_fails_in_one_line_keeps_its_steps_and_resumes(model_dir, tmp_path):
    # SIGSTOP, found by a missed health check in seconds; no restart allowed: no bridge is left.
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", model_dir, run_dir, steps=10_000, eval={"episodes": 0},
                          checkpoint_every=1000, bridge={"max_restarts": 0, "health_timeout_s": 2.0})
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl.run.cli", "train", str(config)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    bridge = None
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or len(read_metrics(run_dir)) < 2:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no step logged"
            time.sleep(0.2)
        [bridge] = [c for c in _children_of(proc.pid)  # python -m bridge serve|env ...
                    if Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0")[3] == b"serve"]
        os.kill(bridge, signal.SIGSTOP)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        if bridge is not None and not gone(bridge):
            os.kill(bridge, signal.SIGKILL)
    assert proc.returncode == 1 and took < 20
    line = error_line(err, "jaxrl train")
    assert line.startswith("jaxrl train: error: no bridge left: every bridge kept dying (bridge.max_restarts=0 "
                           f"within 10 minutes); bridge 0 at ")
    # Found by the watcher's health check, or first by a call under way whose deadline passed.
    assert re.search(rf"\(pid {bridge}\): (missed a health check|stopped answering)", line), line
    assert f"(logs: {run_dir / 'logs' / 'bridge.log'})" in line
    assert "bridge 0's log ends with:" in (run_dir / "logs" / "train_error.log").read_text()
    steps = [r["step"] for r in read_metrics(run_dir)]
    checkpoints = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir())
    assert steps == list(range(1, steps[-1] + 1)) and checkpoints == [steps[-1]]  # every step taken, kept

    summary = summary_of(jaxrl("train", config, "--resume", "--set", f"steps={steps[-1] + 2}"))
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, steps[-1] + 3)) and summary["steps"] == steps[-1] + 2


def test_bridges_killed_and_stopped_mid_step_cost_re_requests_and_restarts_not_the_run(model_dir, tmp_path):
    """Two bridges; at step 2 of 6, while both generate, one is SIGKILLed and the other SIGSTOPped
    (found by a missed health check, seconds later). Their unfinished groups are requested again, the killed
    one is restarted first and given the newest snapshot, and the run ends its 6 steps with every
    group trained exactly once."""
    run_dir = tmp_path / "run"
    # Long episodes, so that the groups in flight at the kill are still in flight when it lands.
    config = write_config(tmp_path / "c.yaml", model_dir, run_dir, steps=6, eval={"episodes": 0},
                          rollout={"groups_per_step": 2, "max_tokens": 96, "max_total_tokens": 128,
                                   "max_prompt_tokens": 64},
                          bridge={"per_host": 2, "health_timeout_s": 4.0}, log={"progress": False, "samples_per_step": 2})
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl.run.cli", "train", str(config)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = None
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or len(read_metrics(run_dir)) < 2:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no step logged"
            time.sleep(0.1)
        killed, stopped = [c for c in _children_of(proc.pid)
                           if Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0")[3] == b"serve"]
        _wait_until_both_generate(killed, run_dir)
        os.kill(killed, signal.SIGKILL)
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.time()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        if stopped is not None and not gone(stopped):
            os.kill(stopped, signal.SIGKILL)
    assert summary_of(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))["steps"] == 6
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[1]["bridges/deaths"] == rows[1]["groups/re_requested"] == 0
    assert rows[-1]["bridges/deaths"] == 2 and rows[-1]["bridges/restarts"] >= 1
    # How many groups were requested again depends on where in the step the signals landed: CI saw
    # 2, 1 and 0 (a step whose episodes were all sent before the stop). That the unfinished groups of
    # a dead bridge are requested again, each delivered once, is test_rollout_client's
    # test_the_groups_of_a_dead_bridge_are_requested_again_and_delivered_once; here, none is lost.
    # The stopped bridge was found within its health timeout (a ping or a health check missed).
    [found] = [line for line in (run_dir / "logs" / "train.log").read_text().splitlines()
               if f"(pid {stopped}) " in line]
    found_at = time.mktime(time.strptime(found[:19], "%Y-%m-%d %H:%M:%S"))
    assert found_at - t0 < 3 * 4.0 and "restarting it" in found
    # Every group of the 6 steps trained once: none twice, none lost.
    trained = sorted(json.loads(line)["group_id"] for line in (run_dir / "samples.jsonl").read_text().splitlines())
    assert trained == sorted(f"{step}-{slot}" for step in range(6) for slot in range(2))
    # The killed bridge's replacement started on the newest snapshot (step 2's weights, version 3, or
    # a later one when the run went on with the other bridge first) and served every one after it.
    [killed_line] = [line for line in err.splitlines() if f"(pid {killed}) was killed by SIGKILL" in line]
    index = int(killed_line.split("bridge ", 1)[1].split()[0])
    log = (run_dir / "logs" / ("bridge.log" if index == 0 else f"bridge-{index}.log")).read_text()
    replacement = log.rsplit("BRIDGE_LISTENING ", 1)[1]
    served = [int(line.split(" version ")[1].split()[0]) for line in replacement.splitlines()
              if "serving snapshot " in line]
    assert served[0] >= 3 and served == list(range(served[0], 8)), served


def _wait_until_both_generate(pid: int, run_dir: Path) -> None:
    """Until each of the run's two bridges has episodes in flight (read with the token in `pid`'s
    environment, as its owner can)."""
    from bridge.client import BridgeClient

    environ = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
    token = environ[b"JAXRL_BRIDGE_TOKEN"].decode()
    addresses = [next(line.split()[1] for line in (run_dir / "logs" / name).read_text().splitlines()
                      if line.startswith("BRIDGE_LISTENING ")) for name in ("bridge.log", "bridge-1.log")]
    clients = [BridgeClient(a, timeout_s=10, token=token) for a in addresses]
    try:
        deadline = time.monotonic() + 60
        while not all(c.stats()["episodes_in_flight"] > 0 for c in clients):
            assert time.monotonic() < deadline, "the bridges never generated at once"
            time.sleep(0.005)
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("size, checkpoint_every", [("2m", 1), ("300k", 100)])
def test_a_full_disk_stops_the_run_in_one_line_and_keeps_its_last_finished_checkpoint(model_dir, tmp_path, size,
                                                                                       checkpoint_every):
    # The run dir is on a small tmpfs (2 MB: room for config, logs and two checkpoints of the tiny model; 300 kB:
    # full before the first checkpoint), mounted in a mount namespace of the run's own: no root needed, nothing
    # left mounted. What the run left there is copied out before the namespace goes.
    disk, kept = tmp_path / "small", tmp_path / "kept"
    disk.mkdir()
    run_dir = disk / "run"
    config = write_config(tmp_path / "c.yaml", model_dir, run_dir, steps=200, eval={"episodes": 0},
                          checkpoint_every=checkpoint_every, keep_checkpoints=2)
    script = (f"mount -t tmpfs -o size={size} tmpfs {disk} && {sys.executable} -m jaxrl.run.cli train {config}; "
              f"code=$?; cp -a {run_dir} {kept}; exit $code")
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # One line says what stopped the run: no thread's or exit hook's complaint about the disk follows it (only
    # jaxrl's warnings and XLA's own log lines, which a busy machine brings, may be there besides).
    assert [line for line in proc.stderr.splitlines() if not line.startswith("jaxrl train: WARNING: ")
            and not re.match(r"[EWI]\d{4} ", line)] == [error_line(proc.stderr, "jaxrl train")], proc.stderr
    failed = re.match(r"jaxrl train: error: disk full: (checkpoint of step (\d+) failed: )?no space left on the "
                      rf"file system of {run_dir}; free some \(or move run_dir\), then (--resume from its last "
                      r"checkpoint \(step (\d+)\)|start it again \(it wrote no checkpoint yet\))",
                      error_line(proc.stderr, "jaxrl train"))
    assert failed, proc.stderr
    checkpoints = kept / "checkpoints"
    assert [p.name for p in checkpoints.iterdir() if not p.name.isdigit()] == []  # nothing half-written
    assert [p.name for p in (kept / "snapshots").iterdir() if not p.name.isdigit()] == []
    if checkpoint_every > 1:
        assert failed.group(4) is None and not any(checkpoints.iterdir())
        return
    newest = max(int(p.name) for p in checkpoints.iterdir())
    assert int(failed.group(4)) == newest
    exported = jaxrl("export", kept, "--checkpoint-step", newest, "--out", tmp_path / "export")
    assert exported.returncode == 0, exported.stderr  # the newest checkpoint restores
    assert read_metrics(kept)[-1]["step"] >= newest
    if failed.group(2):  # a failed checkpoint is found at the next step, not at the next save
        assert read_metrics(kept)[-1]["step"] <= int(failed.group(2)) + 1


def test_a_snapshot_bucket_that_goes_away_stops_the_run_in_one_line_and_it_resumes_on_another(model_dir, tmp_path):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", model_dir, run_dir, steps=6, eval={"episodes": 0}, checkpoint_every=1,
                          snapshot_dir="s3://snapshots/run")
    with s3_server() as s3:
        proc = subprocess.Popen([sys.executable, "-m", "jaxrl.run.cli", "train", str(config)], cwd=ROOT,
                                env={**os.environ, **s3}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _logged_steps(proc, run_dir, more_than=1)
        except BaseException:
            proc.kill()
            raise
    try:  # the bucket's server is gone: the next snapshot cannot be written (or a bridge cannot read it)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert re.match(r"jaxrl train: error: (snapshot )?.*s3://snapshots/run/\d+: cannot be (written|read) \(.*Could "
                    r"not connect", error_line(err, "jaxrl train")), err
    stopped_at = read_metrics(run_dir)[-1]["step"]
    assert stopped_at < 6 and (run_dir / "checkpoints" / str(stopped_at)).is_dir()
    with s3_server() as s3:  # another, empty bucket
        resumed = jaxrl("train", config, "--resume", env={**os.environ, **s3})
    assert summary_of(resumed)["steps"] == 6
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 7))
    assert snapshot_versions(run_dir / "snapshots") == [7]  # the last one served, copied from the bucket


def test_a_run_whose_environments_are_all_down_stops_with_a_clear_error(model_dir, tmp_path):
    server = subprocess.Popen([sys.executable, str(WORKER), "reverse"], stdout=subprocess.PIPE, text=True)
    run_dir = tmp_path / "run"
    try:
        url = server.stdout.readline().split()[1]
        deadline = time.monotonic() + 60
        while not _answers(url):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        config = write_config(tmp_path / "c.yaml", model_dir, run_dir, steps=10_000, eval={"episodes": 0},
                              envs=[{"name": "reverse", "url": url, "retry_budget_s": 1.0, "retry_backoff_s": 0.1}])
        proc = subprocess.Popen([sys.executable, "-m", "jaxrl.run.cli", "train", str(config)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _logged_steps(proc, run_dir, 0)
        children = _children_of(proc.pid)
        server.kill()  # the only environment goes away for good
        out, err = proc.communicate(timeout=180)
    finally:
        server.kill()
        server.wait(10)
    assert proc.returncode == 1
    assert "jaxrl train: error: step" in err and "episodes succeeded" in err and "EndpointUnavailable" in err
    last = max(r["step"] for r in read_metrics(run_dir))
    assert (run_dir / "checkpoints" / str(last)).is_dir()  # the steps taken are kept
    assert not [c for c in children if not gone(c)]


def greedy_answerer(model_dir: Path, tokenizer, width: int = 256):
    """`answer(rubric, max_tokens)`: the model's greedy answer to `rubric` as one user message: full forward
    passes, no engine. The model loaded and its one program compiled once for every answer: one padded
    width (eager calls compiled every op for every length: minutes on a busy machine); causal attention
    keeps what follows a position out of its logits."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from bridge.envs.render import prompt_ids
    from jaxrl.models import load_pretrained

    model = load_pretrained(model_dir)
    forward = nnx.jit(lambda m, tokens: m(tokens, jnp.arange(width)[None], jnp.ones_like(tokens))[0])

    def answer(rubric: str, max_tokens: int) -> str:
        ids = prompt_ids(tokenizer, [{"role": "user", "content": rubric}], None, {})
        said = []
        for _ in range(max_tokens):
            sequence = ids + said
            tokens = np.zeros((1, width), np.int32)
            tokens[0, :len(sequence)] = sequence
            said.append(int(np.argmax(forward(model, tokens)[0, len(sequence) - 1])))
            if said[-1] == tokenizer.eos_token_id:
                break
        return tokenizer.decode(said, skip_special_tokens=True)

    return answer


@pytest.mark.timeout(900)  # three models compiled besides the policy's: ~45 s quiet, past 300 s beside 3 others
def test_a_run_with_a_classifier_and_judges_rewards_them_as_the_models_do_outside_it(model_dir, tmp_path):
    from bridge.classifier import RewardClassifier
    from bridge.envs.spec import RewardSpec
    from bridge.judge import Judge, parse_answer
    from jaxrl.models import load_tokenizer
    from jaxrl.tiny import build_tiny_classifier

    tok = load_tokenizer(model_dir)
    classifier_dir = build_tiny_classifier(tmp_path / "rm", seed=6)
    judge_dir = primed_judge(tmp_path / "judge", tok)
    # TRL-format tasks (a `prompt` of chat messages): reward functions see the conversation reward models read.
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": "Reply. "}], "target": w}) + "\n"
                             for w in ("red", "blue", "green", "gold")))
    rubric = "Task: {prompt} ({target})\nReply:\n{completion}\nScore 0-9:"
    run_dir, recorded = tmp_path / "run", tmp_path / "conversations.jsonl"
    config = write_config(
        tmp_path / "c.yaml", model_dir, run_dir, eval={"episodes": 0}, log={"progress": False, "samples_per_step": 2},
        envs=[{"name": "reply", "env_class": "tests.workers.trl_env:Reply"}], data={"train_file": str(tasks)},
        bridge={"engine_kwargs": {"max_seq_len": 256}},
        rewards=[{"fn": "env"}, {"fn": "tests.workers.rewards:record_conversation"},
                 {"model": str(classifier_dir), "kind": "classifier", "name": "rm", "weight": 0.5},
                 {"model": str(judge_dir), "kind": "judge", "template": rubric, "max_tokens": 4, "name": "judge"},
                 {"kind": "judge", "judge": "policy", "template": "Is this right? {conversation}",
                  "verdicts": {"yes": 1, "no": 0}, "name": "self_judge", "max_tokens": 8}])
    summary = summary_of(jaxrl("train", config, env={**os.environ, "JAXRL_TEST_CONVERSATIONS": str(recorded)}))
    assert summary["steps"] == 3 and summary["programs_after_first_step"] == 0

    metrics = read_metrics(run_dir)
    assert all(r["time/reward_model_s"] > 0 for r in metrics if "time/reward_model_s" in r)
    assert sum(r.get("env/reply/judge_malformed", 0) for r in metrics) > 0  # the untrained policy judges in prose
    episodes = {tok.decode(r["completion_ids"]): r for r in map(json.loads, recorded.read_text().splitlines())}
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6
    outside = RewardClassifier(classifier_dir, 256)
    judge = Judge(RewardSpec(model=str(judge_dir), kind="judge", template=rubric), None, tok, {})
    greedy_answer = greedy_answerer(judge_dir, tok)
    for sample in samples:
        episode = episodes[sample["completion"]]
        conversation = episode["prompt"] + episode["completion"]
        assert sample["rewards"]["rm"] == pytest.approx(asyncio.run(outside.score(conversation)), abs=1e-4)
        answer = greedy_answer(judge.rubric(episode["prompt"], episode["completion"], episode["task"]), 4)
        assert answer == "7" and sample["rewards"]["judge"] == parse_answer(answer, None) == 7.0
