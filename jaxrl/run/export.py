"""Export a run's weights as a Hugging Face model directory that transformers and vLLM load.

A LoRA run exports its adapters as a PEFT adapter directory (`adapter_config.json`,
`adapter_model.safetensors`: `peft.PeftModel.from_pretrained` and vLLM's LoRA requests load it),
or with `merged` the whole model, the adapters merged into the base it trained on.

The source is a weight snapshot (already keyed by Hugging Face names, in the serving dtype) or
a train checkpoint (a whole TrainState; only its `params` are read, as NumPy, without knowing
the tree in advance, and mapped to Hugging Face names with `jaxrl.models.hf.hf_names`). The
output is written next to `out_dir` and renamed into place, so a failed export leaves nothing.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl.models import ModelConfig, from_hf_tensors, hf_names, save_pretrained
from jaxrl.models.config import DTYPES, ModelConfigError
from jaxrl.models.hf import CheckpointError, hf_layout, read_checkpoint, read_config
from jaxrl.models.lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraError, check_adapter_tensors, config_from_peft,
                               merged_tensors, peft_names)
from jaxrl.run.run_dir import RunDir
from jaxrl.snapshots import SnapshotError, SnapshotReader, snapshot_versions

# Files of a model directory that a tokenizer directory must not overwrite.
_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")


class ExportError(ValueError):
    """A source that cannot be exported: names the path, what is wrong and what to do."""


class ExportWarning(UserWarning):
    """Something the export did without, e.g. a run without a saved tokenizer."""


def export(
    source: str | Path,
    out_dir: str | Path,
    version: int | None = None,
    checkpoint_step: int | None = None,
    dtype: str | None = None,
    merged: bool = False,
    base: str | Path | None = None,
) -> Path:
    """Writes `source`'s weights to `out_dir` as config.json + safetensors + tokenizer files.

    `source` is a run directory, its `snapshots/` or `checkpoints/` directory, or one numbered
    snapshot or checkpoint in them. From a run directory the newest snapshot is exported (or
    `version`); with `checkpoint_step`, or when the run has no snapshot, the train checkpoint
    (newest, or that step). The dtype of the source is kept unless `dtype` is given.
    A LoRA run's export is its PEFT adapter directory, or with `merged` the whole model with the
    adapters merged into `base` (default: the base model directory the run trained on, see `_base_of`).
    Returns `out_dir`; raises ExportError for anything it cannot export.
    """
    source, out_dir = Path(source), Path(out_dir)
    if version is not None and checkpoint_step is not None:
        raise ExportError("give a snapshot version or a checkpoint step, not both")
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"dtype={dtype!r}; allowed: {sorted(DTYPES)}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir}: already exists and is not empty; choose a new output directory")

    kind, directory, number, run = _resolve(source, version, checkpoint_step)
    with _on_host():
        if kind == "snapshots":
            cfg, hf_config, tensors, lora = _read_snapshot(directory, number)
        else:
            cfg, hf_config, tensors, lora = _read_checkpoint(directory, number)
        if lora is None and (merged or base is not None):
            raise ExportError(f"{directory}: the run trained every weight (no LoRA adapters): its export is the whole "
                              "model already; leave out --merged and --base")
        if lora is not None and not merged:
            if dtype is not None:
                raise ExportError("--dtype: adapters are exported as trained (float32); it applies to --merged")
            _write_adapters(run, lora, tensors, out_dir)
            return out_dir
        if lora is not None:
            cfg, hf_config, tensors = _merge(cfg, lora, tensors, base or _base_of(lora, run), directory)
        source_dtype = cfg.param_dtype
        cfg = cfg.replace(param_dtype=dtype or source_dtype, dtype=dtype or source_dtype)
        try:
            model = from_hf_tensors(cfg, tensors, source=str(directory))
        except CheckpointError as e:
            raise ExportError(str(e)) from None
        del tensors
        tmp = out_dir.parent / f".{out_dir.name}.export-tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            save_pretrained(model, tmp, hf_config=hf_config)
            _copy_tokenizer(run, tmp, out_dir)
            if out_dir.exists():
                out_dir.rmdir()  # checked empty above
            tmp.rename(out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir


def _resolve(source: Path, version, checkpoint_step) -> tuple[str, Path, int, RunDir | None]:
    """(kind, directory of numbered steps, step number, run directory if known)."""
    if not source.exists():
        raise ExportError(f"{source}: does not exist; give a run directory, or its snapshots/ or checkpoints/")
    if not source.is_dir():
        raise ExportError(f"{source}: not a directory; give a run directory, or its snapshots/ or checkpoints/")
    source = source.absolute()

    # One numbered step: RUN/snapshots/7 or RUN/checkpoints/7.
    step_kind = _step_kind(source)
    if step_kind is not None and source.name.isdigit():
        asked = version if step_kind == "snapshots" else checkpoint_step
        if asked is not None and asked != int(source.name):
            raise ExportError(f"{source}: is {step_kind[:-1]} {source.name}, not {asked}")
        _check_option(source, step_kind, version, checkpoint_step)
        return step_kind, source.parent, int(source.name), _run_of(source.parent)

    run = RunDir(source)
    if run.snapshots.is_dir() or run.checkpoints.is_dir():
        snapshots = snapshot_versions(run.snapshots)
        steps = _checkpoint_steps(run.checkpoints) if run.checkpoints.is_dir() else []
        if checkpoint_step is not None or (version is None and not snapshots and steps):
            return "checkpoints", run.checkpoints, _pick(run.checkpoints, "checkpoint step", steps, checkpoint_step), run
        if version is None and not snapshots:
            raise ExportError(
                f"{source}: the run has no finished weight snapshot in snapshots/ and no finished "
                f"train checkpoint in checkpoints/; nothing to export yet (train until one is saved)"
            )
        return "snapshots", run.snapshots, _pick(run.snapshots, "snapshot version", snapshots, version), run

    kinds = {k for k in map(_step_kind, _numbered(source)) if k}
    if not kinds and source.name in ("snapshots", "checkpoints"):
        kinds = {source.name}
    if len(kinds) != 1:
        raise ExportError(
            f"{source}: neither a run directory (with snapshots/ or checkpoints/) nor a snapshots/ "
            f"or checkpoints/ directory of numbered steps; give the run directory"
        )
    kind = kinds.pop()
    _check_option(source, kind, version, checkpoint_step)
    if kind == "snapshots":
        number = _pick(source, "snapshot version", snapshot_versions(source), version)
    else:
        number = _pick(source, "checkpoint step", _checkpoint_steps(source), checkpoint_step)
    return kind, source, number, _run_of(source)


def _numbered(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.is_dir() and p.name.isdigit()]


def _step_kind(step_dir: Path) -> str | None:
    if (step_dir / "manifest").is_dir() and (step_dir / "weights").is_dir():
        return "snapshots"
    if (step_dir / "state").is_dir() and (step_dir / "meta").is_dir():
        return "checkpoints"
    return None


def _check_option(source: Path, kind: str, version, checkpoint_step) -> None:
    if kind == "snapshots" and checkpoint_step is not None:
        raise ExportError(f"{source}: holds weight snapshots; choose one with a version, not a checkpoint step")
    if kind == "checkpoints" and version is not None:
        raise ExportError(f"{source}: holds train checkpoints; choose one with a checkpoint step, not a version")


def _run_of(directory: Path) -> RunDir | None:
    run = RunDir(directory.parent)
    return run if directory in (run.snapshots, run.checkpoints) else None


def _pick(directory: Path, what: str, have: list[int], wanted: int | None) -> int:
    if wanted is None:
        if not have:
            raise ExportError(f"{directory}: no finished {what.split()[0]} to export yet")
        return have[-1]
    if wanted not in have:
        raise ExportError(f"{directory}: no finished {what} {wanted}; available: {have or 'none'}")
    return wanted


def _checkpoint_manager(directory: Path) -> ocp.CheckpointManager:
    # A reader with explicit handlers: restores without knowing the TrainState's tree.
    return ocp.CheckpointManager(
        directory,
        item_handlers={"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(read_only=True),
    )


def _checkpoint_steps(directory: Path) -> list[int]:
    return sorted(_checkpoint_manager(directory).all_steps())


def _write_adapters(run: RunDir | None, adapter_config: dict, tensors: dict, out_dir: Path) -> None:
    """The PEFT adapter directory (and the run's tokenizer), written beside `out_dir` and renamed in."""
    from safetensors.numpy import save_file

    tmp = out_dir.parent / f".{out_dir.name}.export-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        shutil.copymode(tmp / ADAPTER_CONFIG, tmp / ADAPTER_WEIGHTS)
        _copy_tokenizer(run, tmp, out_dir)
        if out_dir.exists():
            out_dir.rmdir()  # checked empty by `export`
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _base_of(adapter_config: dict, run: RunDir | None) -> Path:
    """The base model the adapters were trained on: as their config names it or, where that directory
    is gone and the run holds its own (a LoRA run whose warm start trained every weight, moved or
    copied since), RUN/base-model."""
    named = Path(adapter_config.get("base_model_name_or_path") or "")
    if not named.is_dir() and run is not None and run.base_model.is_dir():
        return run.base_model
    return named


def _merge(cfg: ModelConfig, adapter_config: dict, adapters: dict, base: str | Path,
           source: Path) -> tuple[ModelConfig, dict, dict]:
    """(config, HF config, tensors) of the base model with the adapters merged in."""
    base = Path(base)
    try:
        hf_config = read_config(base)
        base_cfg = _model_config(hf_config, str(base / "config.json"))
        if any(getattr(base_cfg, k) != getattr(cfg, k) for k in ("hidden_size", "num_layers", "vocab_size",
                                                                  "intermediate_size", "num_heads", "num_kv_heads")):
            raise ExportError(f"{base}: a different model from the one {source}'s adapters were trained on; give the "
                              "base model directory with --base")
        tensors = merged_tensors(cfg, config_from_peft(adapter_config, str(source)), read_checkpoint(base, base_cfg),
                                 adapters)
    except (CheckpointError, LoraError) as e:
        raise ExportError(f"{e}; give the base model directory the run trained on with --base") from None
    return base_cfg, hf_config, tensors


def _lora(adapter_config: dict | None, cfg: ModelConfig, tensors: dict, source: str) -> dict | None:
    """The adapter config, once the tensors are checked to be its adapters on this model."""
    if adapter_config is None:
        return None
    try:
        check_adapter_tensors(cfg, config_from_peft(adapter_config, source), tensors, source)
    except LoraError as e:
        raise ExportError(str(e)) from None
    return adapter_config


def _read_snapshot(directory: Path, version: int) -> tuple[ModelConfig, dict, dict, dict | None]:
    try:
        snapshot = SnapshotReader(directory).load(version)
    except SnapshotError as e:
        raise ExportError(f"{e}; export another version or a train checkpoint") from None
    cfg = _model_config(snapshot.hf_config, f"{snapshot.path}/manifest")
    return (cfg, snapshot.hf_config, snapshot.tensors,
            _lora(snapshot.adapter_config, cfg, snapshot.tensors, f"{snapshot.path}/manifest"))


def _read_checkpoint(directory: Path, step: int) -> tuple[ModelConfig, dict, dict, dict | None]:
    path = directory / str(step)
    manager = _checkpoint_manager(directory)
    try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # Orbax raises many types for missing or damaged items
        raise ExportError(f"{path}/meta: cannot be read ({type(e).__name__}: {e})") from None
    hf_config = meta.get("model_config") if isinstance(meta, dict) else None
    if not isinstance(hf_config, dict):
        raise ExportError(
            f"{path}/meta: has no 'model_config' (the Hugging Face config dict of the trained "
            f"model), so its params cannot be named; export a weight snapshot of the run instead"
        )
    cfg = _model_config(hf_config, f"{path}/meta model_config")
    try:
        tree = manager.item_metadata(step)["state"].tree
    except Exception as e:
        raise ExportError(f"{path}/state: cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(tree, dict) or "params" not in tree:
        raise ExportError(f"{path}/state: has no 'params'; it is not a jaxrl train checkpoint")
    # Only the params subtree: the optimiser state never leaves the disk.
    item = {"params": tree["params"]}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    try:
        params = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
            ),
        )["state"]["params"]
    except Exception as e:
        raise ExportError(f"{path}/state: params cannot be restored ({type(e).__name__}: {e})") from None
    lora = meta.get("lora")
    if lora is not None:
        names = [(name, param_path, True) for name, param_path in peft_names(cfg, config_from_peft(lora, f"{path}/meta"))]
        tensors = _params_to_hf(names, params, path)
        return cfg, hf_config, tensors, _lora(lora, cfg, tensors, f"{path}/meta")
    tensors = _params_to_hf(hf_names(cfg), params, path)
    dtypes = {str(v.dtype) for v in tensors.values()}
    saved = dtypes.pop() if len(dtypes) == 1 else cfg.param_dtype
    return cfg.replace(param_dtype=saved if saved in DTYPES else cfg.param_dtype), hf_config, tensors, None


def _params_to_hf(names, params, path: Path) -> dict[str, np.ndarray]:
    """{HF name: array in HF layout} from a restored params tree (layer indices come back as str), for
    `names`' (HF name, params path, transposed)."""
    tensors, used = {}, set()
    for name, param_path, transposed in names:
        node = params
        for key in param_path:
            if not isinstance(node, dict) or str(key) not in node:
                raise ExportError(
                    f"{path}/state: params lack {'/'.join(map(str, param_path))} ({name}); the "
                    f"checkpoint's model_config does not describe its params"
                )
            node = node[str(key)]
        while isinstance(node, dict) and len(node) == 1 and next(iter(node)) in ("value", "raw_value"):
            node = next(iter(node.values()))  # an nnx.Variable's saved state
        if not isinstance(node, np.ndarray):
            raise ExportError(f"{path}/state: params/{'/'.join(map(str, param_path))} is not an array")
        used.add(id(node))
        tensors[name] = hf_layout(node, transposed)
    extra = [
        "/".join(str(getattr(k, "key", k)) for k in p)
        for p, leaf in jax.tree_util.tree_leaves_with_path(params)
        if id(leaf) not in used
    ]
    if extra:
        raise ExportError(
            f"{path}/state: params {extra[:5]}{' ...' if len(extra) > 5 else ''} are not part of the "
            f"model its model_config describes; the checkpoint and its meta disagree"
        )
    return tensors


def _model_config(hf_config: dict, source: str) -> ModelConfig:
    try:
        return ModelConfig.from_hf(hf_config, source=source)
    except ModelConfigError as e:
        raise ExportError(str(e)) from None


def _copy_tokenizer(run: RunDir | None, tmp: Path, out_dir: Path) -> None:
    files = (
        [p for p in sorted(run.tokenizer.iterdir()) if p.is_file()]
        if run is not None and run.tokenizer.is_dir() else []
    )
    files = [p for p in files if p.name not in _MODEL_FILES and p.suffix != ".safetensors"]
    if not files:
        where = run.tokenizer if run is not None else "the source (not inside a run directory)"
        warnings.warn(
            f"no tokenizer files in {where}: {out_dir} holds the model only; copy the "
            f"tokenizer's files (tokenizer.save_pretrained) into it before loading it with vLLM",
            ExportWarning,
            stacklevel=3,
        )
    for file in files:
        shutil.copy2(file, tmp / file.name)


@contextlib.contextmanager
def _on_host():
    """Builds the export's arrays in host memory, not on an accelerator a trainer may be using."""
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:  # no CPU backend configured: use the default device
        yield
        return
    with jax.default_device(cpu):
        yield
