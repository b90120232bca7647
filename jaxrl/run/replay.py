"""`jaxrl train --replay RUN`: reruns a run from its directory and says whether it came out the same.

The rerun trains RUN/config.yaml into RUN/replay (`--set run_dir=...` puts it elsewhere; other
`--set` overrides apply too), then compares the two metrics.jsonl step by step, every key but those
no rerun repeats (`NOT_COMPARED`). Values must be equal, not close: a sync-mode run on the same
machine and versions repeats its episodes exactly (each samples with seeds derived from the run
seed and its identity, see bridge.wire) and so its updates. Async mode does not: which weights
generate which group depends on timing.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from pathlib import Path
from typing import Any

from jaxrl.run.config import TrainConfig, load_config
from jaxrl.run.run_dir import RunDir
from jaxrl.run.tracking import read_metrics

# Metrics no rerun repeats: wall-clock times and rates, compile counts (a rerun finds the programs
# in the persistent compilation cache) and program counts (a rerun in the same process finds them in
# memory), and waits for environment sessions (which depend on when each episode asked for one).
# The engine's work (its ticks depend on when requests arrive, its seconds on the machine).
# And what the machine did rather than the run: faults survived (bridge deaths, restarts and
# returns, environment server restarts) and what they cost (groups and episodes asked for again, and
# so requests): a replayed episode samples what it would have.
NOT_COMPARED = ("time", "time/*", "step_s", "tokens_per_s", "compiles/*", "programs/*", "env/*/pool_waits",
                "env/*/pool_wait_s", "env/*/capacity_refusals", "bridges/*", "env/*/restarts", "env/*/retries",
                "groups/re_requested", "rollout/episodes_retried", "rollout/requests", "engine/*")
ABSENT = "(absent)"


class ReplayError(ValueError):
    """RUN cannot be replayed (not a run directory, nothing logged, something in the replay's way)."""


def compared(key: str) -> bool:
    return not any(fnmatch.fnmatchcase(key, pattern) for pattern in NOT_COMPARED)


@dataclasses.dataclass(frozen=True)
class Comparison:
    steps: int  # steps that matched
    step: int | None = None  # the first step that differs, if any
    key: str = ""
    recorded: Any = None
    replayed: Any = None

    @property
    def matched(self) -> bool:
        return self.step is None

    def line(self) -> str:
        if self.matched:
            return f"replay matched {self.steps} steps"
        return (f"replay differs at step {self.step} (after {self.steps} matching): {self.key}: "
                f"recorded {self.recorded!r}, replayed {self.replayed!r}")


def compare(recorded: list[dict], replayed: list[dict]) -> Comparison:
    """The recorded run's logged steps against the replay's (steps the replay logged beyond them,
    e.g. the rest of a run stopped early, are not compared)."""
    before, after = _by_step(recorded), _by_step(replayed)
    for n, step in enumerate(sorted(before)):
        if step not in after:
            return Comparison(n, step, "step", "logged", ABSENT)
        for key in sorted(k for k in before[step].keys() | after[step].keys() if compared(k)):
            a, b = before[step].get(key, ABSENT), after[step].get(key, ABSENT)
            if a != b:
                return Comparison(n, step, key, a, b)
    return Comparison(len(before))


def _by_step(rows: list[dict]) -> dict[int, dict]:
    """One dict per step: the final evaluation logs a second row at the last step."""
    out: dict[int, dict] = {}
    for row in rows:
        out.setdefault(row["step"], {}).update(row)
    return out


def replay_config(run_dir: str | Path, overrides: list[str]) -> TrainConfig:
    """RUN's config with run_dir RUN/replay, then `overrides`; ReplayError or ConfigError."""
    run = RunDir(run_dir)
    if not run.config.is_file():
        raise ReplayError(f"--replay {run_dir}: not a run directory (no config.yaml)")
    if not run.metrics.is_file() or not read_metrics(run.path):
        raise ReplayError(f"--replay {run_dir}: the run logged no step, there is nothing to compare")
    cfg = load_config(run.config, [("run_dir", str(run.path / "replay")), *overrides])
    target = Path(cfg.run_dir)
    if target.is_dir() and any(target.iterdir()):
        raise ReplayError(f"{target} holds an earlier replay: remove it, or --set run_dir=ANOTHER_DIR")
    return cfg
