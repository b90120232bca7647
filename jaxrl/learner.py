"""The learner's shell: places the state on the mesh, runs the jitted step, checks metrics."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.models import Decoder
from jaxrl.models.lora import add_lora
from jaxrl.optim import make_optimizer
from jaxrl.models.decoder import QUERY_BLOCK
from jaxrl.packing import dense_keys, pack, segment_lengths
from jaxrl.sharding import BATCH_AXES, batch_sharding, batch_shardings, param_shardings, put_batch
from jaxrl.train_step import (
    LearnerConfig,
    TrainState,
    init_state,
    jit_train_step,
    shared_prompt_rows,
    validate_train_batch,
)


class NonFiniteMetricError(FloatingPointError):
    """A metric became NaN or infinite: the run stops instead of logging it."""


def check_finite(metrics: dict[str, float], step: int) -> None:
    bad = sorted(k for k, v in metrics.items() if not math.isfinite(v))
    if bad:
        raise NonFiniteMetricError(
            f"step {step}: metric(s) {bad} are not finite ({ {k: metrics[k] for k in bad} }); "
            f"the update was not logged. Lower the learning rate, check rewards for inf, or "
            f"resume from the last checkpoint"
        )


def prompt_widths(max_prompt_tokens: int, steps: int) -> tuple[int, ...]:
    """The prompt widths a run's padded batches take (`LearnerConfig.prompt_widths`): the `steps`
    fractions of `max_prompt_tokens` rounded up to whole pairs of query blocks. A step's batch is as
    wide as the first that holds its longest prompt, so the model runs on about the prompt slots the
    step needs, not always on the widest; `Learner` compiles them all at its first step."""
    unit = 2 * QUERY_BLOCK
    return tuple(sorted({min(max_prompt_tokens, -(-max_prompt_tokens * k // (steps * unit)) * unit)
                         for k in range(1, steps + 1)}))


class Learner:
    """Holds the train state on a mesh; `update(batch)` takes one jitted train step.

    With `cfg.lora` the model gets adapters (`add_lora`; a warm start's are kept): the train state
    holds them alone, and the base weights are `frozen`, placed on the mesh beside them and passed
    to every step undonated, so they stay bitwise as loaded.

    `widths`: the prompt widths of the padded batches to come (`prompt_widths`); the step's programs
    for all of them compile with the first batch of one of them, or beforehand in the background
    (`prepare`). A batch of another width (a prompt longer than the run's widest) compiles its own on
    arrival."""

    def __init__(self, model: Decoder, cfg: LearnerConfig, mesh: jax.sharding.Mesh, widths: Sequence[int] = ()):
        self.cfg, self.mesh, self.widths = cfg, mesh, tuple(widths)
        self.dense_keys = dense_keys(model.cfg.hidden_size)
        self.frozen = self.frozen_shardings = None
        if cfg.lora is None:
            self.graphdef, params = nnx.split(model)
        else:
            self.graphdef, params, frozen = nnx.split(add_lora(model, cfg.lora), nnx.LoRAParam, ...)
            self.frozen_shardings = param_shardings(frozen, mesh)
            self.frozen = jax.device_put(frozen, self.frozen_shardings)
        p_shardings = param_shardings(params, mesh)
        params = jax.device_put(params, p_shardings)
        replicated = NamedSharding(mesh, PartitionSpec())
        # The one optimizer of this learner: its state's shapes, the init and every step use it.
        self.tx = tx = make_optimizer(cfg.optimizer)
        opt_shardings = optax.tree_map_params(
            tx, lambda _, s: s, jax.eval_shape(tx.init, params), p_shardings,
            transform_non_params=lambda _: replicated,
        )
        self.shardings = TrainState(
            replicated, p_shardings, opt_shardings, p_shardings if cfg.loss.beta > 0 else None
        )
        self.state: TrainState = jax.jit(
            lambda p: init_state(p, cfg, tx), out_shardings=self.shardings
        )(params)
        self.num_batch_shards = int(np.prod([mesh.shape[a] for a in BATCH_AXES]))
        # Packed rows per micro-batch: one per batch shard unless the config says more (a multiple).
        self.pack_rows = cfg.pack_rows or self.num_batch_shards
        if cfg.pack_tokens is not None and self.pack_rows % self.num_batch_shards:
            raise ValueError(f"learner.pack_rows={cfg.pack_rows} must be a multiple of the mesh's "
                             f"{self.num_batch_shards} batch shards")
        # By (rows sharing each prompt, prompt width).
        self._step_fns: dict[tuple[int, int], jax.stages.Compiled] = {}
        self._prepared: Future | None = None
        self._closing = threading.Event()

    @property
    def step(self) -> int:
        return int(self.state.step)

    def model(self) -> Decoder:
        return nnx.merge(self.graphdef, self.state.params, *(() if self.frozen is None else (self.frozen,)))

    def _pack(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This process's rows of the batch packed; with several processes, each packs its own rows
        and they agree on the micro-batches to run and each one's attention window."""
        n = jax.process_count()
        # A prompt longer than the run's width (which widens its step) widens the rows too.
        longest = int(segment_lengths(batch).max(initial=0))
        if n > 1:
            longest = int(multihost_utils.process_allgather(np.int32(longest)).max())
        width = max(self.cfg.pack_tokens, -(-longest // QUERY_BLOCK) * QUERY_BLOCK)
        rows = len(batch["rewards_BxR"])
        group = self.cfg.group_size if self.cfg.shared_prompts else 1
        if n == 1:
            return pack(batch, width, self.pack_rows, group_size=group, dense_keys=self.dense_keys)
        total = rows * n
        first = min(index.indices(total)[0] for (index,) in
                    batch_sharding(self.mesh, 1).addressable_devices_indices_map((total,)).values())
        whole_groups = first % group == 0 and rows % group == 0  # else a process's rows split groups
        packed = pack(batch, width, self.pack_rows // n, first, total, group if whole_groups else 1, self.dense_keys)
        for key in ("micro_batches", "window_M"):  # every process runs as many, each over the widest window
            packed[key] = multihost_utils.process_allgather(packed[key]).max(axis=0).astype(np.int32)
        return packed

    def prepare(self, batch: dict[str, np.ndarray]) -> None:
        """Compiles (or loads from the persistent cache) the step's programs for batches shaped as
        `batch` (its contents aside: `rl_batch([], ...)` will do) in a background thread, while the
        caller does something else (a run's first rollout); the first `update` waits for them.
        Packed batches' shapes follow their contents: nothing is prepared for them."""
        if self.cfg.pack_tokens is not None or self._prepared is not None or self._step_fns:
            return
        validate_train_batch(batch, self.cfg, self.num_batch_shards // jax.process_count())
        arrays, group = put_batch(batch, self.mesh), shared_prompt_rows(batch, self.cfg)
        pool = ThreadPoolExecutor(1, thread_name_prefix="learner-prepare")
        self._prepared = pool.submit(self._compile, arrays, group, self._widths(arrays["prompt_BxP"].shape[1]),
                                     self._closing)
        pool.shutdown(wait=False)

    def close(self) -> None:
        """Stops `prepare`'s thread once the programs under way are done (a process ends only then)."""
        self._closing.set()

    def _compile(self, arrays: dict[str, jax.Array], group: int, widths: Sequence[int],
                 stop: threading.Event | None = None) -> None:
        """The step's programs for these arrays' shapes at each of `widths`, into `_step_fns`: each
        compiles (or loads) in a worker while the next is lowered, as XLA works outside the GIL. Once
        `stop` is set, what is under way finishes and nothing more starts."""
        with ThreadPoolExecutor(2) as pool:
            compiling = {}
            for key, program in self._lowered(arrays, group, widths):
                if stop is not None and stop.is_set():
                    break
                compiling[key] = pool.submit(program.compile)
            self._step_fns.update({key: future.result() for key, future in compiling.items()})

    def _widths(self, P: int) -> tuple[int, ...]:
        """The prompt widths compiled with a batch of width P (packed batches have one: their prompts'
        width does not size the model's work)."""
        return self.widths if P in self.widths and self.cfg.pack_tokens is None else (P,)

    def _lowered(self, arrays: dict[str, jax.Array], group: int, widths: Sequence[int]):
        """(key, lowered step) for the batches of these arrays' shapes at each of `widths`."""
        jitted = jit_train_step(self.graphdef, self.cfg, self.tx, self.shardings,
                                batch_shardings(self.mesh, arrays), group, self.frozen_shardings)
        for width in widths:
            shapes = {k: jax.ShapeDtypeStruct((a.shape[0], width, *a.shape[2:]) if k.endswith("_BxP") else a.shape,
                                              a.dtype, sharding=a.sharding) for k, a in arrays.items()}
            with jax.set_mesh(self.mesh):
                yield (group, width), jitted.lower(self.state, shapes, self.frozen)

    def _compiled(self, arrays: dict[str, jax.Array], group: int) -> jax.stages.Compiled:
        """The step for these arrays' shapes; with the first of `widths`, those of every width."""
        if self._prepared is not None:
            prepared, self._prepared = self._prepared, None
            prepared.result()
        P = arrays["prompt_BxP"].shape[1]
        if (group, P) not in self._step_fns:
            self._compile(arrays, group, [w for w in self._widths(P) if (group, w) not in self._step_fns])
        return self._step_fns[(group, P)]

    def update(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """One train step on this process's rows of the batch; returns host metrics."""
        validate_train_batch(batch, self.cfg, self.num_batch_shards // jax.process_count())
        if self.cfg.pack_tokens is not None:
            batch, group = {**batch, **self._pack(batch)}, 1
        else:
            group = shared_prompt_rows(batch, self.cfg)
        if jax.process_count() > 1:  # every process must run the same program
            group = int(multihost_utils.process_allgather(np.int32(group)).min())
        arrays = put_batch(batch, self.mesh)
        step_fn = self._compiled(arrays, group)
        step = self.step
        start = time.perf_counter()
        with jax.set_mesh(self.mesh):
            self.state, metrics = step_fn(self.state, arrays, self.frozen)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        wall = time.perf_counter() - start
        tokens = int(np.sum(batch["prompt_mask_BxP"]) + np.sum(batch["completion_mask_BxC"]))
        metrics["tokens_per_s"] = tokens * jax.process_count() * self.cfg.num_iterations / wall
        metrics["step_s"] = wall
        check_finite(metrics, step)
        return metrics
