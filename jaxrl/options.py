"""How every config dataclass, the learner core's and the run layer's, declares a key: its help text
(what `jaxrl config` prints above it, lower case, no closing period) beside its default."""

from __future__ import annotations

import dataclasses
from typing import Any


def option(help: str, **field_kwargs) -> Any:
    """A dataclass field documented by `help` (`default=` / `default_factory=` as for dataclasses.field)."""
    return dataclasses.field(metadata={"help": help}, **field_kwargs)
