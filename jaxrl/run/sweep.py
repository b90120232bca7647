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
```

Each run is named after the values that vary (`learning_rate=1e-05_group_size=8`) and gets
OUT/<run>/config.yaml, the base config with the run's overrides and its run directory set.
Every config is resolved (validated) before the first run starts.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxrl.run.report import compare_runs
from jaxrl.run.run_dir import RunDir
from jaxrl.run.typed_config import ConfigError, dump_yaml, load

# resolve(base config path, [(dotted.key, value), ...]) -> the run's validated config as a dict.
Resolve = Callable[[Path, list[tuple[str, Any]]], dict]


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    base: str = dataclasses.field(metadata={"help": "The run config the sweep varies, relative to the sweep file."})
    name: str = dataclasses.field(default="", metadata={"help": "Default: the sweep file's name."})
    out_dir: str | None = dataclasses.field(default=None, metadata={"help": "Default: runs/sweeps/<name>."})
    grid: dict[str, list[Any]] | None = dataclasses.field(
        default=None, metadata={"help": "dotted.key: [values]; every combination is a run."})
    runs: list[dict[str, Any]] | None = dataclasses.field(
        default=None, metadata={"help": "A list of {dotted.key: value}, one per run."})
    set: dict[str, Any] = dataclasses.field(
        default_factory=dict, metadata={"help": "dotted.key: value set in every run."})
    metric: str = dataclasses.field(default="reward/mean", metadata={"help": "The metric the runs are compared on."})


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
              run_dir_key: str = "run_dir") -> int:
    """Writes the configs, then (unless `dry_run`, which prints the commands) trains the runs.

    Runs go one after another as `train_command + [config_path]`, their output streamed; a
    failed run is recorded and the sweep goes on. At the end the runs are compared
    (report.compare_runs into out_dir) and the table printed. Returns the exit code: 0, 1 if
    a run failed, 130 if interrupted.
    """
    spec, runs = expand(spec_path)
    commands = write_configs(runs, resolve, run_dir_key)
    if dry_run:
        print("\n".join(commands))
        return 0
    failed, code = [], 0
    for number, run in enumerate(runs, 1):
        print(f"sweep {spec.name}: run {number}/{len(runs)}: {run.name}", file=sys.stderr, flush=True)
        try:
            status = _run([*train_command, str(run.config_path)])
            if status in (130, -signal.SIGINT):  # the run was Ctrl-C'd (its exit can beat our own handler)
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            print(f"sweep {spec.name}: interrupted during {run.name}; the later runs did not start", file=sys.stderr)
            code = 130
            break
        if status != 0:
            failed.append(run.name)
            print(f"sweep {spec.name}: {run.name} failed (exit code {status}); going on", file=sys.stderr, flush=True)
    table, plot = compare_runs({run.name: run.run_dir for run in runs}, spec.out_dir, metric=spec.metric)
    print(f"{table}\n\nplot: {plot}\nsummary: {Path(spec.out_dir) / 'summary.md'}")
    if failed:
        print(f"sweep {spec.name}: {len(failed)} of {len(runs)} runs failed: {', '.join(failed)}", file=sys.stderr)
    return code or (1 if failed else 0)


def _run(command: list[str]) -> int:
    """Runs `command` on this process's stdout and stderr; returns its exit code."""
    try:
        proc = subprocess.Popen(command)
    except OSError as e:
        print(f"sweep: cannot start {shlex.join(command)}: {e.strerror}", file=sys.stderr)
        return 127  # the shell's code for a command that cannot run
    with proc:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            # The run got the same Ctrl-C: let it shut down its bridge and environment servers.
            proc.wait()
            raise
