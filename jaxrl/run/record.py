"""RUN/run.json: what a rerun of the run needs besides its config, the seeds, and for each session
(the first start, then every `--resume`) the Python, platform, devices and package versions it ran
on: other versions may compile other kernels and round differently (see `jaxrl train --replay`).

```
{"seeds": {"seed": 0, "data.seed": 0, "model.tiny.seed": 0, "envs.echo.seed": 0, "sampling": "..."},
 "sessions": [{"started": "2026-11-22T20:01:02+00:00", "start_step": 0, "python": "3.11.7",
               "processes": 1, "platform": "Linux x86_64", "devices": "cpu x8", "packages": {"jax": "0.10.2", ...}}]}
```
"""

from __future__ import annotations

import base64
import collections
import datetime
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
from pathlib import Path
from typing import Any

import jax

from jaxrl.run.config import TrainConfig
from jaxrl.run.run_dir import RunDir

# What a run's numbers depend on (distributions), and the modules whose distribution is recorded by what
# is imported, with the distributions known to install them: `openenv` and its predecessor `openenv-core`.
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "transformers", "tokenizers",
            "grpcio", "protobuf")
MODULES = {"openenv": ("openenv", "openenv-core")}
# How a run's sampling seeds derive from its seed (bridge.wire, bridge.rollout).
SAMPLING = ("group: derive_seed(seed, group id), group ids STEP-SLOT (training) and eval-VERSION-I; "
            "episode j: derive_seed(group seed, j); turn k: derive_seed(episode seed, k)")


def environment() -> dict[str, Any]:
    """This process's Python, platform, devices and package versions (None: not installed)."""
    kinds = collections.Counter(d.device_kind for d in jax.devices())
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = None
    for module, names in MODULES.items():
        dist = imported_distribution(module, names)
        packages[dist.metadata["Name"] if dist else module] = dist.version if dist else None
    return {"python": platform.python_version(), "platform": f"{platform.system()} {platform.machine()}",
            "devices": ", ".join(f"{kind} x{n}" for kind, n in sorted(kinds.items())), "packages": packages}


def imported_distribution(module: str, names: tuple[str, ...] = ()) -> importlib.metadata.Distribution | None:
    """The installed distribution whose files are the ones `import module` loads (None: not importable): of
    several that install the same directory, the one whose recorded hash matches the file on disk. The
    installed ones of `names` are checked first; every installed distribution is listed (which reads the
    metadata of each, a slow part of a run's start) only when none of them owns the file."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin).resolve()
    named = []
    for name in names:
        try:
            named.append(importlib.metadata.distribution(name))
        except importlib.metadata.PackageNotFoundError:
            pass
    found = _recorded_owner(named, origin)
    if found is not None:
        return found
    owners = [importlib.metadata.distribution(n) for n in importlib.metadata.packages_distributions().get(module, [])]
    return owners[0] if len(owners) == 1 else _recorded_owner(owners, origin)


def _recorded_owner(dists: list[importlib.metadata.Distribution], origin: Path) -> importlib.metadata.Distribution | None:
    """The one of `dists` whose record has `origin` with the hash of its bytes on disk."""
    for dist in dists:
        for file in dist.files or []:
            if file.hash is not None and Path(dist.locate_file(file)).resolve() == origin:
                digest = base64.urlsafe_b64encode(hashlib.new(file.hash.mode, origin.read_bytes()).digest())
                if digest.rstrip(b"=").decode() == file.hash.value:
                    return dist
    return None


def seeds(cfg: TrainConfig) -> dict[str, Any]:
    """Every seed the config sets, and how the sampling seeds derive from them."""
    out: dict[str, Any] = {"seed": cfg.seed, "data.seed": cfg.data.seed}
    if cfg.model.tiny is not None:
        out["model.tiny.seed"] = cfg.model.tiny.seed
    out.update({f"envs.{e.name}.seed": e.seed for e in cfg.envs if e.bundled})
    out["sampling"] = SAMPLING
    return out


def record_session(run: RunDir, cfg: TrainConfig, start_step: int | None) -> None:
    """Starts RUN/run.json for a fresh run (`start_step` None), or adds a resumed session to it."""
    if jax.process_index() != 0:
        return
    path = run.record
    record = {"seeds": seeds(cfg), "sessions": []}
    if start_step is not None and path.is_file():
        record = json.loads(path.read_text())
    record["sessions"].append({
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "start_step": start_step or 0, "processes": jax.process_count(), **environment()})
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def differences(run: RunDir) -> list[str] | None:
    """What this process runs on that no session of the run recorded ("jax 0.10.2 (recorded
    0.10.1)"); None without a record."""
    if not run.record.is_file():
        return None
    recorded = [_flat(s) for s in json.loads(run.record.read_text()).get("sessions", [])]
    out = []
    for key, value in _flat(environment()).items():
        seen = sorted({str(r.get(key)) for r in recorded})
        if str(value) not in seen:
            out.append(f"{key} {value} (recorded {' / '.join(seen)})")
    return out


def _flat(env: dict[str, Any]) -> dict[str, Any]:
    return {**{k: v for k, v in env.items() if k != "packages"}, **env.get("packages", {})}
