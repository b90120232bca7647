"""Tasks a run trains and evaluates on: a pure function of (config, step), so a resumed run
draws exactly the tasks the interrupted one would have.

A task is `(env name, task fields)`; the fields go to the environment's `reset(**fields)` and
to the reward functions. Seed-drawn tasks are `{"seed": k}` (bundled environments also get
`"split"`); an environment of `data.splits` gets `{"split", "index"}` tasks of its own task
routes (each a task of its server's list, whatever seeds it ignores); a JSON-lines file gives
explicit rows `{"env": name, ...fields}`, or rows of a TRL dataset as they are: `prompt` (a string or chat messages, to which the bridge appends reset's
text) and any other columns, the environment named by `env`, by TRL's `environment` column, or
being the run's only one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from bridge.envs.spec import EnvConfigError, task_prompt, task_splits
from jaxrl.run.config import TrainConfig

EVAL_SEED_OFFSET = 1_000_000  # seed-drawn held-out tasks of non-bundled environments start here

Task = tuple[str, dict[str, Any]]


class TaskError(ValueError):
    """A task file that cannot be used; the message names the file and line."""


def read_task_file(path: str | Path, env_names: list[str]) -> list[Task]:
    tasks = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise TaskError(f"task file {path}: {e.strerror or e}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"task file {path} line {i}: not JSON ({e.msg})") from None
        where = f"task file {path} line {i}"
        if not isinstance(row, dict):
            raise TaskError(f"{where}: a task is a JSON object, got {row!r}")
        # TRL routes rows by `environment` and keeps it from reset(); reward functions get it as `env`.
        key = "env" if "env" in row else "environment"
        env = row.pop(key, env_names[0] if len(env_names) == 1 else None)
        if env not in env_names:
            raise TaskError(f"{where}: needs \"env\" (or TRL's \"environment\") naming one of {env_names}, got "
                            f"{env!r}")
        if "prompt" in row:
            try:
                task_prompt(row["prompt"])
            except ValueError as e:
                raise TaskError(f"{where}: {e}") from None
        tasks.append((env, row))
    if not tasks:
        raise TaskError(f"task file {path} has no tasks")
    return tasks


def _rows(path: str | None, key: str, env_names: list[str]) -> list[Task] | None:
    """The tasks of the file `key` names (None: it names none); TaskError naming `key` and the file."""
    try:
        return read_task_file(path, env_names) if path else None
    except TaskError as e:
        raise TaskError(f"{key}: {e}") from None


class TaskSource:
    """Training tasks by (step, slot) and the fixed held-out set."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.names = [e.name for e in cfg.envs]
        self.bundled = {e.name for e in cfg.envs if e.bundled}
        self.train_rows = _rows(cfg.data.train_file, "data.train_file", self.names)
        self.eval_rows = _rows(cfg.data.eval_file, "data.eval_file", self.names)
        weights = [cfg.data.mix.get(n, 1.0 if not cfg.data.mix else 0.0) for n in self.names]
        if sum(weights) <= 0:
            raise TaskError(f"data.mix gives every environment weight 0: {cfg.data.mix}")
        self.weights = weights
        self.split_sizes = {env: _split_sizes(cfg, env) for env in cfg.data.splits}

    def _fields(self, env: str, seed: int, split: str) -> dict[str, Any]:
        fields: dict[str, Any] = {"seed": seed}
        if env in self.split_sizes:
            name = self.cfg.data.splits[env]["train" if split == "train" else "eval"]
            fields = {"split": name, "index": seed % self.split_sizes[env][name]}
        elif env in self.bundled:
            fields["split"] = split
        elif split == "test":
            fields["seed"] = EVAL_SEED_OFFSET + seed
        fields.update(self.cfg.data.task_fields.get(env, {}))
        return fields

    def train(self, step: int, slot: int) -> Task:
        """The task of group `slot` (refills continue the slot count) at `step`."""
        rng = random.Random(f"{self.cfg.data.seed}:{step}:{slot}")
        if self.train_rows is not None:
            epoch_len = len(self.train_rows)
            index = step * self.cfg.rollout.groups_per_step + slot
            order = list(range(epoch_len))
            random.Random(f"{self.cfg.data.seed}:epoch:{index // epoch_len}").shuffle(order)
            env, row = self.train_rows[order[index % epoch_len]]
            return env, dict(row)
        env = rng.choices(self.names, self.weights)[0]
        return env, self._fields(env, rng.randrange(2**31), "train")

    def held_out(self, env: str | None = None, n: int | None = None, split: str = "test") -> list[Task]:
        """The evaluation tasks: `n` (default eval.episodes) spread over the environments (or `env`'s),
        from the held-out `split` (`train`: seed-drawn tasks of the training split instead)."""
        n = self.cfg.eval.episodes if n is None else n
        if self.eval_rows is not None and split == "test":
            rows = [t for t in self.eval_rows if env is None or t[0] == env]
            return [(e, dict(r)) for e, r in rows[:n]]
        names = [env] if env is not None else self.names
        return [(names[i % len(names)], self._fields(names[i % len(names)], i // len(names), split))
                for i in range(n)]

    def first_train(self, env: str) -> dict[str, Any] | None:
        """`env`'s first training row, or a seed-drawn training task; None when the file has no row of it."""
        if self.train_rows is None:
            return self._fields(env, 0, "train")
        return next((dict(row) for e, row in self.train_rows if e == env), None)

    def demonstrations(self, n: int, envs: list[str]) -> list[Task]:
        """`n` training tasks for solver demonstrations, split evenly over `envs`, seeds from the run's."""
        tasks = []
        for k, env in enumerate(envs):
            tasks += [(env, self._fields(env, self.cfg.seed + i, "train")) for i in range(len(range(k, n, len(envs))))]
        return tasks


def _split_sizes(cfg: TrainConfig, env: str) -> dict[str, int]:
    """How many tasks `env`'s train and eval splits (data.splits) hold on its server; TaskError if either is
    not one of its splits or is empty."""
    spec = next(e for e in cfg.envs if e.name == env)
    try:
        sizes = task_splits(spec)
    except EnvConfigError as e:
        raise TaskError(f"data.splits.{env}: {e}") from None
    for key, name in cfg.data.splits[env].items():
        if not sizes.get(name):
            listed = ", ".join(f"{k} ({n} tasks)" for k, n in sizes.items()) or "none"
            raise TaskError(f"data.splits.{env}.{key}: {name!r} is not a split of tasks of environment {env!r}; "
                            f"its splits: {listed}")
    return {name: sizes[name] for name in cfg.data.splits[env].values()}


def checked_tasks(cfg: TrainConfig) -> TaskSource:
    """The run's tasks, read before anything starts, and one reset of each `env_class` environment
    on its first training task and first held-out one (by the bridge's code, as the bridge would:
    `jaxrl.run.env_probe`): a task file that cannot be read, or a task an environment cannot take (a
    seed-drawn held-out task for a reset that needs a dataset column), stops the run in one line.
    StartupError."""
    from jaxrl.run.env_probe import probe
    from jaxrl.run.services import StartupError

    try:
        tasks = TaskSource(cfg)
    except TaskError as e:
        raise StartupError(str(e)) from None
    # Bundled and served environments take seed tasks; a rollout_fn has no reset.
    specs = [spec for spec in cfg.envs if spec.env_class]
    items, fixes = [], []
    for spec in specs:
        held_out = tasks.held_out(spec.name, 1) if cfg.eval.episodes else []
        for what, task, fix in (
                ("first training task", tasks.first_train(spec.name), "fix data.train_file"),
                ("held-out task", held_out[0][1] if held_out else None,
                 "give data.eval_file rows it can take, or set eval.episodes: 0")):
            if task is not None:
                items.append({"env": spec.name, "task": task, "what": what})
                fixes.append(fix)
    if not items:
        return tasks
    envs = {"envs": [spec.to_dict() for spec in specs], "tool_parser": cfg.bridge.tool_parser,
            "chat_template_kwargs": cfg.bridge.chat_template_kwargs}
    try:
        results = probe(envs, items)
    except EnvConfigError as e:
        raise StartupError(str(e)) from None
    for result, fix in zip(results, fixes):
        if "refused" in result:
            raise StartupError(f"{result['refused']}; {fix}")
        if "error" in result:  # the environment itself, whatever the task: the message says what to set
            raise StartupError(result["error"])
    return tasks
