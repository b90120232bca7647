"""`jaxrl sweep SWEEP.yaml`: one base config, many runs, one comparison.

```yaml
name: lr_group                   # default: the sweep file's name
base: tiny_cpu.yaml              # the run config, relative to this file
out_dir: runs/sweeps/lr_group    # default runs/sweeps/<name>, relative to the working directory
grid:                            # the cartesian product, in key order ...
  learner.optimizer.learning_rate: [1e-5, 3e-5]
  learner.group_size: [4, 8]
# runs:                          # ... or an explicit list of runs
#   - {learner.optimizer.learning_rate: 1e-5, learner.group_size: 4}
set: {steps: 50}                 # set in every run
metric: reward/mean              # the metric the runs are compared on
launcher: local                  # local (this machine) or slurm (one SLURM job per run)
parallel: 2                      # local: runs at once, each on its own CPUs (and GPUs)
# slurm: {partition: gpu, nodes: 1, gpus_per_node: 8, time_min: 240, sbatch: {qos: high}}
```

The base may be a gin file, and then the keys may be gin binding names too
(`OptimizerConfig.learning_rate: [1e-5, 3e-5]`).

Each run is named after the values that vary (`learning_rate=1e-05_group_size=8`) and gets
OUT/<run>/config.yaml, the base config with the run's overrides and its run directory set.
Every config is resolved (validated) before the first run starts.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import re
import shlex
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from jaxrl.options import option
from jaxrl.run.launchers import LocalRun, SlurmSpec, cancel_slurm, launch_local, launch_slurm, read_state, slurm_states
from jaxrl.run.report import compare_runs
from jaxrl.run.run_dir import RunDir
from jaxrl.run.tracking import read_metrics
from jaxrl.run.typed_config import ConfigError, dump_yaml, load, read_yaml

# resolve(base config path, [(dotted.key, value), ...]) -> the run's validated config as a dict.
Resolve = Callable[[Path, list[tuple[str, Any]]], dict]


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    base: str = option("the run config the sweep varies, relative to the sweep file")
    name: str = option("default: the sweep file's name", default="")
    out_dir: str | None = option("default: runs/sweeps/<name>", default=None)
    grid: dict[str, list[Any]] | None = option("dotted.key: [values]; every combination is a run", default=None)
    runs: list[dict[str, Any]] | None = option("a list of {dotted.key: value}, one per run", default=None)
    set: dict[str, Any] = option("dotted.key: value set in every run", default_factory=dict)
    metric: str = option("the metric the runs are compared on", default="reward/mean")
    launcher: Literal["local", "slurm"] = option(
        "local: on this machine; slurm: one SLURM job per run (submitit)", default="local")
    parallel: int = option("local: runs at once, each on its share of the CPUs and GPUs", default=1)
    slurm: SlurmSpec = option("slurm: the jobs' resources", default_factory=SlurmSpec)


@dataclasses.dataclass(frozen=True)
class SweepRun:
    name: str
    overrides: dict[str, Any]
    run_dir: Path
    config_path: Path
    base: Path


def expand(spec_path: str | Path) -> tuple[SweepSpec, list[SweepRun]]:
    """The sweep file's spec (name, out_dir and base filled in) and its runs, in order."""
    spec_path = Path(spec_path)
    spec = load(SweepSpec, spec_path)
    if (spec.grid is None) == (spec.runs is None):
        raise ConfigError(
            f"{spec_path}: a sweep needs exactly one of `grid:` (dotted.key: [values]) "
            f"or `runs:` (a list of {{dotted.key: value}}); it has {'both' if spec.grid is not None else 'neither'}"
        )
    if spec.grid is not None:
        empty = [key for key, values in spec.grid.items() if not values]
        if not spec.grid or empty:
            what = f"grid key '{empty[0]}' has no values" if empty else "`grid:` is empty"
            raise ConfigError(f"{spec_path}: {what}: give each key a list of at least one value")
        varied = [dict(zip(spec.grid, values)) for values in itertools.product(*spec.grid.values())]
    else:
        if not spec.runs:
            raise ConfigError(f"{spec_path}: `runs:` is empty: list at least one run")
        varied = spec.runs
    base = spec_path.parent / spec.base
    if not base.is_file():
        raise ConfigError(f"{spec_path}: base config {base} not found (`base:` is relative to the sweep file)")
    name = spec.name or spec_path.stem
    out_dir = Path(spec.out_dir) if spec.out_dir else Path("runs/sweeps") / name
    spec = dataclasses.replace(spec, name=name, out_dir=str(out_dir), base=str(base))
    runs = [
        SweepRun(run_name, spec.set | overrides, out_dir / run_name, RunDir(out_dir / run_name).config, base)
        for run_name, overrides in zip(run_names(varied), varied)
    ]
    return spec, runs


def run_names(varied: Sequence[dict[str, Any]]) -> list[str]:
    """File-name-safe names from the values that differ between runs: `lr=1e-05_group_size=8`."""
    keys = list(dict.fromkeys(k for overrides in varied for k in overrides))
    differing = [k for k in keys if len({_text(o.get(k, "<unset>")) for o in varied}) > 1]
    keys = differing or keys
    # The last part of a dotted key is its name, unless two keys share it.
    last = [k.rsplit(".", 1)[-1] for k in keys]
    short = {k: s if last.count(s) == 1 else k for k, s in zip(keys, last)}
    names, seen = [], {}
    for overrides in varied:
        name = "_".join(f"{short[k]}={_text(overrides[k])}" for k in keys if k in overrides) or "base"
        name = re.sub(r"[^A-Za-z0-9._=+-]+", "-", name)
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return names


def _text(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "-".join(_text(v) for v in value)
    if isinstance(value, dict):
        return "-".join(f"{k}={_text(v)}" for k, v in value.items())
    return str(value)


def write_configs(runs: Sequence[SweepRun], resolve: Resolve, run_dir_key: str = "run_dir") -> list[str]:
    """Resolves every run's config, then writes each to its config_path; returns the train commands.

    `run_dir_key`: the dotted config key that names a run's directory; it is set to the run's.
    If any run's config is invalid, nothing is written and the ConfigError names every such run.
    """
    resolved, errors = [], {}
    for run in runs:
        overrides = [*run.overrides.items(), (run_dir_key, str(run.run_dir))]
        try:
            resolved.append(resolve(run.base, overrides))
        except ValueError as e:
            errors.setdefault(str(e), []).append(run.name)
    if errors:
        failed = sum(len(names) for names in errors.values())
        lines = [f"{', '.join(names)}: {message}" for message, names in errors.items()]
        raise ConfigError(
            f"{failed} of {len(runs)} sweep runs have invalid configs, so none ran:\n  " + "\n  ".join(lines)
        )
    for run, config in zip(runs, resolved):
        dump_yaml(config, run.config_path)
    return [shlex.join(["jaxrl", "train", str(run.config_path)]) for run in runs]


def run_sweep(spec_path: str | Path, resolve: Resolve, dry_run: bool, train_command: Sequence[str],
              run_dir_key: str = "run_dir", launcher: str | None = None, parallel: int | None = None,
              wait: bool = True, cancel_on_interrupt: bool = False) -> int:
    """Writes the configs, then (unless `dry_run`, which prints the commands) trains the runs.

    Each run is `train_command + [config_path]` (with `--resume` on SLURM, so that a requeued job
    continues), launched by the sweep's `launcher` (or this one) with its `parallel` (or this); a
    failed run is recorded and the sweep goes on. OUT/sweep.json lists the runs (and their jobs) for
    `jaxrl sweep status` and `report`. When the runs are over (or, on SLURM, with `wait` False, as
    soon as they are submitted) the finished ones are compared (report.compare_runs into out_dir).
    Returns the exit code: 0, 1 if a run failed, 130 if interrupted. Ctrl-C stops local runs at a
    checkpoint; SLURM jobs keep running unless `cancel_on_interrupt`.
    """
    spec, runs = expand(spec_path)
    spec = dataclasses.replace(spec, launcher=launcher or spec.launcher, parallel=parallel or spec.parallel)
    if spec.parallel < 1:
        raise ConfigError(f"parallel={spec.parallel}: run at least 1 run at a time")
    commands = write_configs(runs, resolve, run_dir_key)
    if dry_run:
        print("\n".join(commands))
        return 0
    out_dir = Path(spec.out_dir)
    say = functools.partial(_say, spec.name)
    if spec.launcher == "slurm":
        command = [*train_command, "--resume"]
        jobs = launch_slurm([LocalRun(r.name, [*command, str(r.config_path.absolute())], r.run_dir.absolute())
                             for r in runs], spec.slurm, out_dir.absolute() / "slurm", spec.name)
        _write_manifest(spec, runs, jobs)
        say(f"submitted {len(jobs)} SLURM jobs: {', '.join(jobs)} (logs: {out_dir / 'slurm'}); "
            f"`jaxrl sweep status {out_dir}` shows them")
        code = _follow(spec, runs, jobs, say, cancel_on_interrupt) if wait else 0
    else:
        _write_manifest(spec, runs, None)
        codes, interrupted = launch_local([LocalRun(r.name, [*train_command, str(r.config_path)], r.run_dir)
                                           for r in runs], spec.parallel, say)
        if interrupted:
            not_run = [r.name for r in runs if r.name not in codes]
            say("interrupted" + (f"; these runs did not start: {', '.join(not_run)}" if not_run else ""))
        failed = [name for name, c in codes.items() if c not in (0, 130, -signal.SIGINT)]
        if failed:
            say(f"{len(failed)} of {len(runs)} runs failed: {', '.join(failed)}")
        code = 130 if interrupted else 1 if failed else 0
    print(report(out_dir))
    return code


def _follow(spec: SweepSpec, runs: Sequence[SweepRun], jobs: Sequence[str], say, cancel: bool) -> int:
    """Waits for the SLURM jobs, saying each run's state change; 1 if one failed, 130 after Ctrl-C."""
    seen: dict[str, str] = {}
    try:
        while True:
            rows = status(spec.out_dir)
            for row in rows:
                if seen.get(row.name) != row.state:
                    seen[row.name] = row.state
                    say(f"{row.name}: {row.state}" + (f" ({row.detail})" if row.detail else ""))
            if all(row.state in FINAL for row in rows):
                return 1 if any(row.state != "done" for row in rows) else 0
            time.sleep(5)
    except KeyboardInterrupt:
        if cancel:
            cancel_slurm(jobs)
            say(f"interrupted: cancelled jobs {', '.join(jobs)}")
        else:
            say(f"interrupted: the jobs keep running (scancel {' '.join(jobs)} to stop them); "
                f"`jaxrl sweep status {spec.out_dir}` and `jaxrl sweep report {spec.out_dir}` follow them")
        return 130


def _say(name: str, text: str) -> None:
    print(f"sweep {name}: {text}", file=sys.stderr, flush=True)


# ---- what a sweep directory holds -------------------------------------------------------

MANIFEST = "sweep.json"
FINAL = ("done", "failed", "stopped")


@dataclasses.dataclass(frozen=True)
class RunStatus:
    name: str
    state: str  # queued, running, done, failed, stopped
    step: int  # the last step it logged
    steps: int  # the steps it trains
    detail: str  # the job, the error line


def _write_manifest(spec: SweepSpec, runs: Sequence[SweepRun], jobs: Sequence[str] | None) -> None:
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, run in enumerate(runs):
        steps = read_yaml(run.config_path).get("steps")
        entries.append({"name": run.name, "run_dir": str(run.run_dir.absolute()), "steps": steps,
                        "job_id": jobs[i] if jobs else None})
    (out / MANIFEST).write_text(json.dumps({"name": spec.name, "launcher": spec.launcher, "metric": spec.metric,
                                            "runs": entries}, indent=1))


def _manifest(out_dir: str | Path) -> dict:
    path = Path(out_dir) / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{out_dir} is not a launched sweep's directory (no {MANIFEST}): give the sweep's "
                          "out_dir") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None


def status(out_dir: str | Path) -> list[RunStatus]:
    """Each run's state: queued (not started, or its job pending), running (with its last step),
    done, failed (with its error line) or stopped (by a signal, or its launcher went away)."""
    manifest = _manifest(out_dir)
    jobs = slurm_states([r["job_id"] for r in manifest["runs"] if r["job_id"]])
    rows = []
    for entry in manifest["runs"]:
        run_dir = Path(entry["run_dir"])
        rows_logged = read_metrics(run_dir) if RunDir(run_dir).metrics.exists() else []
        step = rows_logged[-1]["step"] if rows_logged else 0
        job = jobs.get(entry["job_id"] or "")
        state = read_state(run_dir) or {}
        detail = f"job {entry['job_id']}" if entry["job_id"] else ""
        if job in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING"):
            name = "queued"
        elif job is not None or (state.get("state") == "running" and _alive(state)):
            name = "running"
        elif state.get("state") == "running":  # its process or job is gone without a word
            name, detail = "stopped", "its process or job ended without recording how"
        else:
            name = state.get("state", "queued")
            if name in ("failed", "stopped") and state.get("error"):
                detail = f"exit code {state['exit_code']}: {state['error']}"
        rows.append(RunStatus(entry["name"], name, step, entry["steps"] or 0, detail))
    return rows


def _alive(state: dict) -> bool:
    """Whether a local run's process still runs (a run on another host is taken at its word)."""
    if state.get("job_id") or state.get("host") != socket.gethostname() or not state.get("pid"):
        return True
    try:
        os.kill(state["pid"], 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def status_table(rows: Sequence[RunStatus]) -> str:
    lines = [("run", "state", "step", "detail")]
    lines += [(r.name, r.state, f"{r.step}/{r.steps}", r.detail) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(3)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d}".rstrip() for a, b, c, d in lines)


def report(out_dir: str | Path) -> str:
    """Compares the sweep's runs (those not finished with what they logged so far): OUT/summary.md and
    OUT/compare_reward.png; returns the table with where they are."""
    manifest = _manifest(out_dir)
    table, plot = compare_runs({r["name"]: r["run_dir"] for r in manifest["runs"]}, out_dir, metric=manifest["metric"])
    return f"{table}\n\nplot: {plot}\nsummary: {Path(out_dir) / 'summary.md'}"
