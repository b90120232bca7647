"""The layout of a run directory: one place that names every file a run writes.

```
RUN/
  config.yaml      the resolved run config
  metrics.jsonl    one JSON object per logged step
  checkpoints/     train checkpoints (jaxrl.checkpoints.TrainCheckpointer)
  snapshots/       weight snapshots for the bridge (jaxrl.snapshots.SnapshotWriter)
  tokenizer/       the run's tokenizer, written with `tokenizer.save_pretrained`
```
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class RunDir:
    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    @classmethod
    def create(cls, path: str | Path) -> RunDir:
        """The run directory at `path`, with its subdirectories made (existing ones are kept)."""
        run = cls(path)
        for directory in (run.checkpoints, run.snapshots, run.tokenizer):
            directory.mkdir(parents=True, exist_ok=True)
        return run

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def snapshots(self) -> Path:
        return self.path / "snapshots"

    @property
    def tokenizer(self) -> Path:
        return self.path / "tokenizer"

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"
