"""Train checkpoints for exact resume: the whole TrainState plus run metadata, through Orbax.

Saves are asynchronous; Orbax writes `<step>.orbax-checkpoint-tmp` and renames it on commit, so a
process killed mid-save leaves the previous checkpoints intact; a save that fails (a full disk)
has its temporary directory removed once the failure surfaces. Restores take the target's
shardings, so a run can resume on a different mesh than the one that saved it.

A save compiles nothing: a run's first checkpoint comes after its first step, when nothing may
compile. Orbax's replica-parallel saving (its default on CPU and TPU) has each replica of a
replicated array (LoRA adapters, norms) write a slice of it, and each slice is a program of its
own per replica, device and shape (24 for a tiny LoRA run on 8 devices). Each shard is written
whole by its first replica instead, as Orbax does on GPU; a multi-host run whose weights are
replicated across hosts (a `data` axis over hosts) then writes them from the hosts holding those
replicas rather than spread over all of them.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxrl.train_step import TrainState


# Whole shards: see the module's docstring.
_HANDLERS = ocp.type_handlers.create_type_handler_registry(
    (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)))


class CheckpointMismatchError(ValueError):
    """A checkpoint whose arrays do not fit the configured model and optimiser."""


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _shapes_by_path(tree) -> dict[str, tuple]:
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        names = [_key_name(k) for k in path]
        # An nnx.Variable's array sits under a `value` key that only some trees spell out.
        if names and names[-1] == "value":
            names.pop()
        out["/".join(names)] = tuple(leaf.shape)
    return out


def abstract_like(state: TrainState, shardings: TrainState) -> TrainState:
    """Shape/dtype/sharding skeleton to restore into."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )


class CheckpointFailed(RuntimeError):
    """A save that did not finish; the message names its step, the cause says why."""


class TrainCheckpointer:
    """Keeps the last `keep` checkpoints of a run under `directory`, saving every `every` steps."""

    def __init__(self, directory: str | Path, keep: int = 3, every: int = 1, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.every = every
        self._saving: int | None = None  # the step of the last save started, until it is known to be done
        # Named handlers let a fresh process read metadata before its first save.
        self.manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={"state": ocp.PyTreeCheckpointHandler(type_handler_registry=_HANDLERS),
                           "meta": ocp.JsonCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=async_save,
                cleanup_tmp_directories=True,
            ),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: TrainState, meta: dict[str, Any], force: bool = False) -> bool:
        """Starts saving (returns at once when async); `meta` must be JSON (config, RNG, data position).
        Called every step: a save that failed since is raised here (CheckpointFailed), not at the next
        save `every` steps later."""
        if self._saving is not None and not self.manager.is_saving_in_progress():
            self.wait()  # done: returns at once, or raises its error
        if not force and step % self.every:
            return False
        if self._saving is not None:
            self.wait()  # Orbax's save would wait for it too, and blame its failure on this step
        try:
            saved = self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)),
                force=force,
            )
        except Exception as e:
            self._discard_unfinished()
            raise CheckpointFailed(f"checkpoint of step {step} failed") from e
        except BaseException:
            # An interrupt (a second Ctrl-C) may leave the save going on in the background: `close`
            # waits for it, and a start-up removes what an unfinished one left.
            self._saving = step
            raise
        self._saving = step if saved else self._saving
        return saved

    def restore(self, target: TrainState, step: int | None = None) -> tuple[TrainState, dict]:
        """Restores `step` (default: latest) onto `target`'s shapes and shardings."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{self.directory}: no finished checkpoint to resume from")
        self._check_shapes(step, target)
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(target, ocp.checkpoint_utils.construct_restore_args(target)),
                meta=ocp.args.JsonRestore()),
        )
        return restored["state"], restored["meta"]

    def _check_shapes(self, step: int, target: TrainState) -> None:
        saved = _shapes_by_path(self.manager.item_metadata(step)["state"])
        if not saved:
            raise CheckpointMismatchError(f"checkpoint {self.directory / str(step)} holds no train state")
        wanted = _shapes_by_path(target)
        problems = [(k, f"checkpoint {saved[k]}, configured {wanted[k]}")
                    for k in saved.keys() & wanted.keys() if saved[k] != wanted[k]]
        problems += [(k, "only in the checkpoint") for k in saved.keys() - wanted.keys()]
        problems += [(k, "missing from the checkpoint") for k in wanted.keys() - saved.keys()]
        # Parameters first: they name the model difference; optimiser moments only repeat it.
        problems = [f"{k}: {what}" for k, what in sorted(problems, key=lambda p: (not p[0].startswith("params/"), p[0]))]
        if problems:
            shown = "\n  ".join(problems[:8]) + (f"\n  ... {len(problems) - 8} more" if len(problems) > 8 else "")
            raise CheckpointMismatchError(
                f"checkpoint {self.directory / str(step)} does not match the configured model/optimiser "
                f"({len(problems)} differing arrays):\n  {shown}\nResume with the config the run was "
                f"started with, or start a new run directory."
            )

    def wait(self) -> None:
        """Until the save under way is done; CheckpointFailed if it failed. An interrupt ends the
        wait, not the save, which `close` then waits for."""
        step, self._saving = self._saving, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            self._discard_unfinished()
            raise CheckpointFailed(f"checkpoint of step {step} failed") from e
        except BaseException:
            self._saving = step
            raise

    def close(self) -> None:
        """Waits for the save under way and ends the manager. A save one part of which failed (a full disk)
        has others still writing into its temporary directory when `wait` raises: the manager's close waits
        for those, and what they left is removed then."""
        try:
            self.wait()
        finally:
            try:
                self.manager.close()
            finally:
                self._discard_unfinished()

    def _discard_unfinished(self) -> None:
        """A failed save (a full disk) leaves its temporary directory behind: remove it, so that only
        finished checkpoints are visible. Called once the failure surfaced, when no save is running."""
        for path in self.directory.glob("*.orbax-checkpoint-tmp*"):
            shutil.rmtree(path, ignore_errors=True)
