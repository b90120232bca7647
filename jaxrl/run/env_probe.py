"""What a run checks of its environments before it trains, run by the bridge's own code in a process of its
own (`python -m bridge env probe`), so that the trainer never imports an environment or the bridge's runtime:
a reset of an in-process environment on the tasks it will take, and the first prompt an episode hands the
engine, whose length sizes `rollout.max_prompt_tokens` where the config leaves it null.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bridge.envs.spec import EnvConfigError

# A probe imports the environments' code and resets each once (an in-process chess opponent: ~1 s).
PROBE_TIMEOUT_S = 300.0


def probe(envs: dict[str, Any], items: list[dict[str, Any]], model_dir: Path | None = None) -> list[dict[str, Any]]:
    """`bridge.envs.probe.probe`'s results for `items` over the environments file `envs`, run in a process of its
    own (with `model_dir`'s tokenizer where an item renders a prompt). EnvConfigError when the probe cannot run."""
    with tempfile.TemporaryDirectory(prefix="jaxrl-probe-") as tmp:
        (Path(tmp) / "envs.json").write_text(json.dumps(envs))
        (Path(tmp) / "items.json").write_text(json.dumps(items, default=str))
        cmd = [sys.executable, "-m", "bridge", "env", "probe", "--envs", str(Path(tmp) / "envs.json"),
               "--items", str(Path(tmp) / "items.json")] + (["--model", str(model_dir)] if model_dir else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise EnvConfigError(f"the environments did not start an episode within {PROBE_TIMEOUT_S:.0f} s "
                                 f"(environments {sorted({i['env'] for i in items})}); check that they start") from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        said = proc.stderr.strip().splitlines()
        raise EnvConfigError(f"checking the environments failed: {said[-1] if said else f'exit {proc.returncode}'}")
    return json.loads(lines[-1])["results"]


def prompt_budget(tokens: int) -> int:
    """`rollout.max_prompt_tokens` for a longest first prompt of `tokens` tokens: a quarter more (other tasks'
    prompts may be longer), rounded up to a multiple of 64."""
    return max(64, -(-(tokens * 5 // 4) // 64) * 64)


def sized(cfg, envs: dict[str, Any], tasks, model_dir: Path, out=sys.stderr):
    """`cfg` with `rollout.max_prompt_tokens` sized from the first prompt of each environment's first training
    task (`prompt_budget` of the longest), where the config leaves it null; said on `out`. Environments that
    build their own prompts (rollout_fn, harness) are not measured. EnvConfigError when one cannot start."""
    if cfg.rollout.max_prompt_tokens is not None:
        return cfg
    items = [{"env": spec.name, "task": tasks.first_train(spec.name) or {}, "what": "first training task",
              "prompt": True} for spec in cfg.envs if not (spec.rollout_fn or spec.harness)]
    lengths = {}
    for item, result in zip(items, probe(envs, items, model_dir) if items else []):
        if "prompt_ids" not in result:
            raise EnvConfigError(f"{result.get('refused') or result.get('error')} (while sizing "
                                 "rollout.max_prompt_tokens from its first prompt; or set it)")
        lengths[item["env"]] = len(result["prompt_ids"])
    if lengths:
        env = max(lengths, key=lengths.get)
        budget = prompt_budget(lengths[env])
        print(f"jaxrl: rollout.max_prompt_tokens sized to {budget}: environment {env!r}'s first prompt has "
              f"{lengths[env]} tokens (set the key to fix it)", file=out, flush=True)
    else:
        budget = 512  # every environment builds its own prompts: what the engine must hold is up to them
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_prompt_tokens=budget))
