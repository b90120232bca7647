"""The device mesh (`data`, `fsdp`, `expert`, `tp`) and where parameters and batches live on it."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.models.decoder import LOGICAL_AXIS_RULES
from jaxrl.options import option

MESH_AXES = ("data", "fsdp", "expert", "tp")
# Sequences are split over every axis that does not split the model's heads (an MoE layer's tokens meet
# their experts across the `expert` axis: `jaxrl.models.moe.expert_parallel`).
BATCH_AXES = ("data", "fsdp", "expert")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape; one axis may be -1 to take the devices left over."""

    data: int = option("data-parallel axis size (replicated parameters); -1: the devices left over", default=1)
    fsdp: int = option("fully sharded data-parallel axis size; -1: the devices left over", default=-1)
    tp: int = option("tensor-parallel axis size", default=1)
    expert: int = option(
        "expert-parallel axis size: a mixture-of-experts model's experts (and their optimiser state) are split "
        "over it, each device holding 1/expert of every MoE layer's, and the batch too; -1: the devices left over",
        default=1)

    def shape(self, num_devices: int) -> tuple[int, int, int, int]:
        sizes = [self.data, self.fsdp, self.expert, self.tp]
        if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
            raise ValueError(f"mesh={dataclasses.asdict(self)}: sizes must be >= 1, at most one -1")
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(f"mesh={dataclasses.asdict(self)} does not divide {num_devices} devices")
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise ValueError(
                f"mesh={dataclasses.asdict(self)} needs {math.prod(sizes)} devices, {num_devices} are available"
            )
        return tuple(sizes)


def make_mesh(cfg: MeshConfig, devices=None) -> jax.sharding.Mesh:
    devices = jax.devices() if devices is None else devices
    shape = cfg.shape(len(devices))
    # Auto axes: classic GSPMD propagation (jax.make_mesh now defaults to Explicit).
    return jax.make_mesh(
        shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def logical_to_mesh(axes: tuple, shape: tuple, mesh, rules=LOGICAL_AXIS_RULES) -> PartitionSpec:
    """Mesh axes of one array; a dimension the mesh axis does not divide stays replicated."""
    rule = dict(rules)
    spec = []
    for name, dim in zip(axes, shape):
        mesh_axis = rule.get(name)
        spec.append(mesh_axis if mesh_axis and dim % mesh.shape[mesh_axis] == 0 else None)
    return PartitionSpec(*spec)


def param_shardings(params: nnx.State, mesh) -> nnx.State:
    """NamedSharding of every parameter from its `out_sharding` logical axes."""

    def one(var):
        axes = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
        return var.replace(NamedSharding(mesh, logical_to_mesh(tuple(axes), var.shape, mesh)))

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def batch_shardings(mesh, batch: dict) -> dict[str, NamedSharding]:
    """Where each array of a learner batch lives: its rows over the batch axes (packed micro-batches,
    `*_MxRxL` and `*_MxRxLxU`: their rows, the second axis), the packing's per-step numbers on every device."""
    def one(key, ndim):
        if key.endswith(("_MxRxL", "_MxRxLxU")):
            return NamedSharding(mesh, PartitionSpec(None, BATCH_AXES, *([None] * (ndim - 2))))
        if key in ("window_M", "micro_batches"):
            return NamedSharding(mesh, PartitionSpec())
        return batch_sharding(mesh, ndim)
    return {k: one(k, np.ndim(v)) for k, v in batch.items()}


def put_batch(batch: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
    """Global arrays from this process's rows of the batch (all rows on a single host)."""
    shardings = batch_shardings(mesh, batch)
    return {k: jax.make_array_from_process_local_data(shardings[k], np.asarray(v)) for k, v in batch.items()}
