"""One run over several processes (hosts), on jax.distributed: start-up from the cluster's
environment or explicit settings, each process's share of a step's groups, and the small values
the processes exchange each step.

Every process runs `jaxrl train` with the same config. Each starts its own bridge(s) and
environment servers, collects its share of every step's groups (`share_of`: the rows of the
global batch that the mesh puts on its devices, whole groups) and feeds the learner those rows
only (`jaxrl.sharding.put_batch`); no process sees another's trajectories. What the processes do
exchange each step (`exchange_step`) is small: every kept episode's summary (rewards, lengths,
counts), the widest prompt, and whether one of them was asked to stop. So every process computes
the run's metrics, not its share's, and takes the same decisions (stop, prompt width), which the
collective steps after them (train step, snapshot, checkpoint) need. Process 0 alone writes the
run directory's metrics, logs, plots and samples; checkpoints and snapshots are collective saves
in which every process writes its own shards.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import warnings
from typing import Any

import jax

from jaxrl.run.collection import EpisodeSummary, Share, StepRollouts
from jaxrl.run.config import DistributedConfig, TrainConfig
from jaxrl.run.services import StartupError
from jaxrl.sharding import BATCH_AXES, batch_sharding


def cluster_processes() -> int:
    """The process count of the cluster environment that `jax.distributed.initialize()` detects
    (SLURM, Open MPI, a TPU pod...); 1 when there is none."""
    from jax._src import clusters  # initialize()'s own detection: jax has no public call for it

    with warnings.catch_warnings():  # Kubernetes without the `kubernetes` package: not a cluster to us
        warnings.simplefilter("ignore")
        for env in clusters.ClusterEnv._cluster_types:
            if not env.opt_in_only_method and env.is_env_present():
                return int(env.get_process_count())
    return 1


def initialize(cfg: DistributedConfig) -> int:
    """Starts jax.distributed when `cfg` or the cluster environment asks for several processes
    (before anything touches the devices); returns the run's process count."""
    explicit = cfg.coordinator is not None or cfg.num_processes is not None
    if jax.distributed.is_initialized():
        return jax.process_count()
    if cfg.num_processes == 1 or not (explicit or (cfg.auto and cluster_processes() > 1)):
        return 1
    try:
        jax.distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id,
                                   initialization_timeout=cfg.timeout_s)
    except (RuntimeError, ValueError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise StartupError(f"distributed: jax.distributed.initialize failed ({first}); give every process the same "
                           "--coordinator (process 0's host:port) and --num-processes, and its own --process-id"
                           ) from None
    return jax.process_count()


def share_of(mesh: jax.sharding.Mesh, cfg: TrainConfig) -> Share:
    """This process's groups of every step: those whose rows of the global batch the mesh puts
    on this process's devices, which must be whole groups, and no other process's."""
    g, size, n = cfg.rollout.groups_per_step, cfg.learner.group_size, jax.process_count()
    if n == 1:
        return Share(0, g, g)
    rows = g * size
    shards = 1
    for axis in BATCH_AXES:
        shards *= mesh.shape[axis]
    if shards % n or rows % shards:
        raise StartupError(f"mesh: data x fsdp = {shards} must split a step's {rows} rows evenly over {n} processes; "
                           f"set mesh.data or mesh.fsdp to a multiple of {n} that divides {rows}")
    indices = batch_sharding(mesh, 1).addressable_devices_indices_map((rows,)).values()
    mine = sorted({row for (index,) in indices for row in range(*index.indices(rows))})
    lo, hi = mine[0], mine[-1] + 1
    if mine != list(range(lo, hi)) or (hi - lo) * n != rows:
        raise StartupError(f"mesh: process {jax.process_index()} holds rows {mine} of a step's {rows}: each "
                           "process needs a block of its own; put the processes on the mesh's data or fsdp axis")
    if lo % size or hi % size:
        raise StartupError(f"rollout.groups_per_step={g} does not split over {n} processes in whole groups "
                           f"({rows // n} rows each, groups of learner.group_size={size}); make it a multiple of {n}")
    return Share(lo // size, (hi - lo) // size, g)


class Exchange:
    """Gathers a small JSON value from every process of the run, in process order, through
    jax.distributed's key-value store (the coordinator), never through the devices."""

    def __init__(self, timeout_s: float):
        self.timeout_ms = int(timeout_s * 1000)
        self.rounds = itertools.count()

    def gather(self, value: Any) -> list[Any]:
        n = jax.process_count()
        if n == 1:
            return [value]
        from jax._src.distributed import global_state  # the coordinator's store: jax has no public call for it

        client, me, round_ = global_state.client, jax.process_index(), next(self.rounds)
        client.key_value_set(f"jaxrl/{round_}/{me}", json.dumps(value))
        try:
            client.wait_at_barrier(f"jaxrl/{round_}", self.timeout_ms)
        except Exception as e:  # jax's runtime error: the others are gone or slower than the timeout
            raise RuntimeError(f"process {me}: the other processes did not reach exchange {round_} within "
                               f"distributed.timeout_s={self.timeout_ms // 1000} ({str(e).strip()[:200]})") from None
        values = dict(client.key_value_dir_get(f"jaxrl/{round_}/"))
        if round_:  # every process read the previous round before it reached this barrier
            client.key_value_delete(f"jaxrl/{round_ - 1}/{me}")
        return [json.loads(values[f"jaxrl/{round_}/{p}"]) for p in range(n)]


@dataclasses.dataclass
class StepView:
    """A step as every process sees it after the exchange."""

    groups: list[list[EpisodeSummary]]  # every process's kept groups, in process order
    counts: collections.Counter  # the processes' collection counts, summed
    prompt_len: int  # the batch's prompt width, the same on every process
    stop: bool  # a process was asked to stop: every process stops after this step
    sums: dict[str, float]  # per-process figures, summed
    maxima: dict[str, float]  # per-process figures, the largest (timings: the slowest share)


def exchange_step(exchange: Exchange, result: StepRollouts, prompt_len: int, stop: bool,
                  sums: dict[str, float], maxima: dict[str, float]) -> StepView:
    """Every process's share of a step, put together (one round of `exchange`)."""
    mine = {"groups": [[dataclasses.asdict(e) for e in g] for g in result.summaries()],
            "counts": dict(result.counts), "prompt_len": prompt_len, "stop": stop, "sums": sums, "maxima": maxima}
    everyone = exchange.gather(mine)
    counts: collections.Counter = collections.Counter()
    summed: collections.Counter = collections.Counter()
    maxima_all: dict[str, float] = {}
    for share in everyone:
        counts.update(share["counts"])
        summed.update(share["sums"])
        for k, v in share["maxima"].items():
            maxima_all[k] = max(maxima_all.get(k, v), v)
    return StepView([[EpisodeSummary(**e) for e in g] for share in everyone for g in share["groups"]], counts,
                    max(share["prompt_len"] for share in everyone), any(share["stop"] for share in everyone),
                    {k: float(v) for k, v in summed.items()}, maxima_all)
