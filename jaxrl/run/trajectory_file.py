"""Trajectories on disk, as JSON lines (one trajectory per line, its arrays as lists), for training
the learner on them later without a bridge (offline ablations) or reading them with anything else.
A file holds groups: the trajectories of a group are adjacent and read back as one list."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from bridge.wire import IDS, LOGPROBS, MASK, VERSIONS, TrajectoryData

ARRAYS = {"prompt_ids": IDS, "completion_ids": IDS, "sampler_logprobs": LOGPROBS, "loss_mask": MASK,
          "token_versions": VERSIONS, "teacher_logprobs": LOGPROBS, "routes": np.dtype("<u2")}
# Files written before distillation have no teacher logprobs, before MoE no routes. Routes read back
# as uint16, which holds any expert id (the learner casts them to its model's route dtype).
OPTIONAL = ("teacher_logprobs", "routes")


class TrajectoryFileError(ValueError):
    """A trajectory file that cannot be read; the message names the file and line."""


def save_trajectories(path: str | Path, groups: Iterable[Sequence[TrajectoryData]], append: bool = False) -> Path:
    """Writes (or with `append` adds) `groups` to the JSON-lines file `path`; returns it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if append else "w") as f:
        for group in groups:
            for t in group:
                row = dataclasses.asdict(t)
                row.update({k: np.asarray(getattr(t, k)).tolist() for k in ARRAYS})
                f.write(json.dumps(row) + "\n")
    return path


def load_trajectories(path: str | Path) -> list[list[TrajectoryData]]:
    """The groups in `path`, in file order; TrajectoryFileError naming the line that cannot be read."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise TrajectoryFileError(f"trajectory file {path}: {e.strerror or e}") from None
    fields = {f.name for f in dataclasses.fields(TrajectoryData)}
    groups: list[list[TrajectoryData]] = []
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            row.update({k: np.asarray(row[k] if k not in OPTIONAL else row.get(k, []), dtype.newbyteorder("="))
                        for k, dtype in ARRAYS.items()})
            row["routes"] = row["routes"].reshape(len(row["routes"]), -1 if len(row["routes"]) else 0)
            t = TrajectoryData(**{k: v for k, v in row.items() if k in fields})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise TrajectoryFileError(f"trajectory file {path} line {i}: not a trajectory ({type(e).__name__}: "
                                      f"{e})") from None
        if groups and groups[-1][0].group_id == t.group_id:
            groups[-1].append(t)
        else:
            groups.append([t])
    return groups
