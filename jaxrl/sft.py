"""Supervised warm start on solver demonstrations, and held-out evaluation of a policy.

A demonstration is an episode played through the REAL environment hook with the environment's
own solver choosing each action, so its tokens are exactly those the policy sees and writes in
reinforcement learning: the chat-template prompt, the solver's actions written as model replies
(loss mask 1), and what the environment answers (loss mask 0). `run_sft` trains on them with the
learner's `sft` loss (token-mean negative log-likelihood) and writes a Hugging Face model
directory; `evaluate` plays held-out episodes greedily with the JAX engine in-process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bridge.engines.base import SamplingParams
from bridge.envs.bundled import BUNDLED, NAMES as BUNDLED_NAMES
from bridge.envs.episode import EnvRuntime
from bridge.envs.spec import ENV_REWARD, EnvSpec, RewardSpec
from bridge.rollout import ENV_VERSION, Trajectory, run_episode
from bridge.tool_calls import get_parser
from jaxrl.losses import LossConfig
from jaxrl.models import Decoder, load_pretrained, positions_from_mask, save_pretrained
from jaxrl.models.decoder import head_logits
from jaxrl.optim import OptimizerConfig
from jaxrl.sharding import MeshConfig, make_mesh
from jaxrl.train_step import LearnerConfig

if TYPE_CHECKING:
    from jaxrl.config import SFTConfig

MAX_DEMO_TURNS = 64  # a solver that has not finished by then is broken, not slow


# -- environments -------------------------------------------------------------------------------


def bundled_name(spec: EnvSpec) -> str | None:
    """The bundled environment `spec` plays (by `bundled` or by its in-process class), else None."""
    if spec.bundled:
        return spec.bundled
    for name in BUNDLED_NAMES:
        env_cls = BUNDLED[name].env_cls
        if spec.env_class == f"{env_cls.__module__}:{env_cls.__qualname__}":
            return name
    return None


def in_process_spec(spec: EnvSpec) -> EnvSpec:
    """A `bundled` spec as its in-process Environment class (no server); other specs unchanged."""
    if not spec.bundled:
        return spec
    entry = BUNDLED[spec.bundled]
    return dataclasses.replace(
        spec, bundled=None,
        env_class=f"{entry.env_cls.__module__}:{entry.env_cls.__qualname__}",
        action_class=f"{entry.action_cls.__module__}:{entry.action_cls.__qualname__}",
    )


def seed_tasks(spec: EnvSpec, n: int, split: str, seed: int = 0,
               task_fields: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Reset arguments of `n` tasks drawn by seed from a bundled environment's `split`."""
    if bundled_name(spec) is None:
        raise ValueError(f"environment {spec.name!r} is not a bundled environment: it has no seeded "
                         f"tasks; pass the tasks explicitly")
    return [{"seed": seed + i, "split": split, **(task_fields or {})} for i in range(n)]


# -- demonstrations -----------------------------------------------------------------------------


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One call in the Qwen / Hermes format that `bridge.tool_calls` parses."""
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def reply_text(action: Any, connector: Any) -> str:
    """The model reply that makes the hook play `action` in the connector's action mode."""
    fields = action.model_dump(exclude={"metadata"}) if hasattr(action, "model_dump") else dict(action)
    mode = connector.mode
    if mode == "text":
        return fields[connector.text_field]
    if mode == "tool_call":
        return tool_call_text(fields["tool"], fields.get("arguments") or {})
    if mode == "mcp":
        return tool_call_text(fields["tool_name"], fields.get("arguments") or {})
    if mode == "tool":
        return tool_call_text(connector.action_tool["function"]["name"], fields)
    raise ValueError(f"environment {connector.spec.name!r}: cannot demonstrate action mode {mode!r}")


async def demonstration_trajectory(runtime: EnvRuntime, env_name: str, task: dict[str, Any],
                                   solve: Callable[[list[dict]], Any]) -> Trajectory:
    """One episode with `solve(observations) -> Action` as the policy, through the real hook.

    The trajectory is what `bridge.rollout.run_episode` would record had the model written the
    solver's replies (tokenized, plus EOS): model tokens loss mask 1, environment tokens 0.
    """
    await runtime.start()
    tok = runtime.tokenizer
    hook = runtime.hook(env_name, task)
    traj = Trajectory(f"demo-{env_name}", 0, [], env=env_name)
    try:
        traj.prompt_ids = await hook.start()
        while True:
            if traj.num_turns >= MAX_DEMO_TURNS:
                raise RuntimeError(f"environment {env_name!r}: the solver's episode on task {task} did not "
                                   f"end within {MAX_DEMO_TURNS} turns")
            text = reply_text(solve(hook.episode.record.observations), hook.connector)
            reply = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            traj.append(reply, [0.0] * len(reply), True, 0)
            traj.num_turns += 1
            result = await hook.turn(reply)
            if result.done:
                break
            traj.append(result.append_ids, [], False, ENV_VERSION)
        traj.finish_reason = "env_done"
        traj.rewards.update(await hook.finish(traj))
        traj.metrics.update(hook.metrics)
    finally:
        await hook.close()
    return traj


def demonstrations(env_specs: Sequence[EnvSpec], tokenizer: Any, n: int, split: str = "train", seed: int = 0,
                   task_fields: dict[str, dict[str, Any]] | None = None,
                   tool_parser: str = "qwen") -> list[Trajectory]:
    """`n` solver episodes of bundled environments (round-robin over `env_specs`), tasks by seed.

    Each demonstration must earn its environment's full reward; a solver that fails one is an
    error, never silent bad data.
    """
    if n < 1 or not env_specs:
        raise ValueError(f"demonstrations: need n >= 1 and at least one environment (n={n}, "
                         f"{len(env_specs)} environments)")
    names = [bundled_name(s) for s in env_specs]
    missing = [s.name for s, b in zip(env_specs, names) if b is None]
    if missing:
        raise ValueError(f"environment(s) {missing} have no solver: demonstrations come from bundled "
                         f"environments ({', '.join(BUNDLED_NAMES)})")
    runtime = EnvRuntime([in_process_spec(s) for s in env_specs], tokenizer, get_parser(tool_parser),
                         [RewardSpec(ENV_REWARD)])
    jobs = []
    for k, (spec, name) in enumerate(zip(env_specs, names)):
        count = len(range(k, n, len(env_specs)))
        for task in seed_tasks(spec, count, split, seed, (task_fields or {}).get(spec.name)):
            jobs.append((spec.name, task, BUNDLED[name].solve))

    async def play_all():
        try:
            await runtime.start()
            return await asyncio.gather(*(demonstration_trajectory(runtime, *job) for job in jobs))
        finally:
            await runtime.aclose()

    trajs = asyncio.run(play_all())
    for traj, (env, task, _) in zip(trajs, jobs):
        if traj.rewards.get(ENV_REWARD, 0.0) < 1.0:
            raise RuntimeError(f"environment {env!r}: the solver's demonstration of task {task} earned "
                               f"reward {traj.rewards}, not 1")
    return trajs


# -- batches ------------------------------------------------------------------------------------


def demo_widths(trajectories: Sequence[Trajectory], multiple: int = 8) -> tuple[int, int]:
    """(prompt, completion) widths that fit every trajectory, rounded up to `multiple`."""
    up = lambda x: -(-x // multiple) * multiple  # noqa: E731
    return (up(max(len(t.prompt_ids) for t in trajectories)),
            up(max(len(t.completion_ids) for t in trajectories)))


def sft_batch(trajectories: Sequence[Trajectory], pad_id: int, prompt_len: int | None = None,
              completion_len: int | None = None) -> dict[str, np.ndarray]:
    """The learner's batch: prompts left-padded, completions right-padded, rewards zeros (unused)."""
    P = prompt_len or max(len(t.prompt_ids) for t in trajectories)
    C = completion_len or max(len(t.completion_ids) for t in trajectories)
    from jaxrl.rollouts import empty_batch

    batch = empty_batch(len(trajectories), P, C, 1, pad_id)
    for b, t in enumerate(trajectories):
        p, c = len(t.prompt_ids), len(t.completion_ids)
        if not 0 < p <= P or c > C or len(t.loss_mask) != c:
            raise ValueError(f"trajectory {b} ({t.env}) has {p} prompt / {c} completion tokens and "
                             f"{len(t.loss_mask)} loss-mask entries; the batch holds {P} / {C}, and "
                             f"every trajectory needs a prompt")
        batch["prompt_BxP"][b, P - p:] = t.prompt_ids
        batch["prompt_mask_BxP"][b, P - p:] = 1
        batch["completion_BxC"][b, :c] = t.completion_ids
        batch["completion_mask_BxC"][b, :c] = 1
        batch["loss_mask_BxC"][b, :c] = t.loss_mask
    return batch


@functools.partial(jax.jit, static_argnames="graphdef")
def _greedy_hits(graphdef, params, prompt_BxP, prompt_mask_BxP, completion_BxC, completion_mask_BxC):
    model: Decoder = nnx.merge(graphdef, params)
    tokens = jnp.concatenate([prompt_BxP, completion_BxC], axis=1)
    mask = jnp.concatenate([prompt_mask_BxP, completion_mask_BxC], axis=1)
    h_BxTxD, _ = model.hidden(tokens, positions_from_mask(mask), mask)
    logits_BxCxV = head_logits(h_BxTxD[:, prompt_BxP.shape[1] - 1:-1], model.head_weight())
    return jnp.argmax(logits_BxCxV, -1) == completion_BxC


def teacher_forced_accuracy(model: Decoder, trajectories: Sequence[Trajectory], pad_id: int,
                            batch_size: int = 64) -> dict[str, float]:
    """How often greedy decoding would write each demonstrated model token, given the ones before.

    `token_accuracy` over loss-masked tokens; `sequence_accuracy`: demonstrations whose every
    model token is the argmax (greedy decoding reproduces them exactly).
    """
    graphdef, params = nnx.split(model)
    widths = demo_widths(trajectories)
    hits = tokens = sequences = 0
    for i in range(0, len(trajectories), batch_size):
        batch = sft_batch(trajectories[i:i + batch_size], pad_id, *widths)
        hit = np.asarray(_greedy_hits(graphdef, params, batch["prompt_BxP"], batch["prompt_mask_BxP"],
                                      batch["completion_BxC"], batch["completion_mask_BxC"]))
        mask = batch["loss_mask_BxC"].astype(bool)
        hits += int((hit & mask).sum())
        tokens += int(mask.sum())
        sequences += int((hit | ~mask).all(1).sum())
    return {"token_accuracy": hits / max(tokens, 1), "sequence_accuracy": sequences / len(trajectories)}


# -- training -----------------------------------------------------------------------------------


def sft_learner_config(steps: int, learning_rate: float, warmup_steps: int | None = None) -> LearnerConfig:
    """AdamW at `learning_rate`, linear warmup (default a tenth of the steps) then cosine to 10%."""
    warmup = max(steps // 10, 1) if warmup_steps is None else warmup_steps
    return LearnerConfig(
        group_size=1, loss=LossConfig(loss_type="sft"),
        optimizer=OptimizerConfig(learning_rate=learning_rate, schedule="cosine", warmup_steps=min(warmup, steps),
                                  total_steps=steps, final_lr_fraction=0.1),
    )


def sft_envs(specs: Sequence[EnvSpec], names: Sequence[str] = ()) -> list[EnvSpec]:
    """The specs to demonstrate: those named (each must be bundled), else every bundled one."""
    by_name = {s.name: s for s in specs}
    unknown = sorted(set(names) - set(by_name))
    if unknown:
        raise ValueError(f"sft.envs names unknown environment(s) {unknown}; envs: {list(by_name)}")
    chosen = [by_name[n] for n in names] if names else [s for s in specs if bundled_name(s)]
    if not chosen:
        raise ValueError(f"sft: no bundled environment among {list(by_name)} to demonstrate; the warm "
                         f"start needs a solver ({', '.join(BUNDLED_NAMES)})")
    return chosen


def run_sft(model_dir: str | Path, out_dir: str | Path, specs: Sequence[EnvSpec], cfg: SFTConfig,
            mesh_cfg: MeshConfig = MeshConfig(), seed: int = 0,
            task_fields: dict[str, dict[str, Any]] | None = None, tool_parser: str = "qwen",
            on_step: Callable[[int, dict[str, float]], None] | None = None) -> dict[str, float]:
    """Warm-starts the model in `model_dir` on train-split demonstrations; writes it to `out_dir`.

    Every process generates the same demonstrations and feeds the learner its share of each
    batch's rows. `on_step(step, metrics)` sees every update's metrics. Returns the final loss, the teacher-forced
    accuracies on the demonstrations and the wall times.
    """
    from transformers import AutoTokenizer

    if cfg.steps < 1:
        raise ValueError(f"sft.steps={cfg.steps}: nothing to train (the warm start needs steps >= 1)")
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    demos = demonstrations(sft_envs(specs, cfg.envs), tokenizer, cfg.demonstrations, "train", seed,
                           task_fields, tool_parser)
    demo_s = time.perf_counter() - start

    from jaxrl.learner import Learner

    learner = Learner(load_pretrained(model_dir), sft_learner_config(cfg.steps, cfg.learning_rate),
                      make_mesh(mesh_cfg))
    widths = demo_widths(demos)
    n_proc, proc = jax.process_count(), jax.process_index()
    if cfg.batch_size % n_proc:
        raise ValueError(f"sft.batch_size={cfg.batch_size} does not split over {n_proc} processes")
    rng = np.random.default_rng(seed)
    order: list[int] = []
    losses = []
    for step in range(cfg.steps):
        rows = []
        while len(rows) < cfg.batch_size:  # epochs of shuffled demonstrations, batches across them
            if not order:
                order = rng.permutation(len(demos)).tolist()
            rows.append(demos[order.pop()])
        share = cfg.batch_size // n_proc
        metrics = learner.update(sft_batch(rows[proc * share:(proc + 1) * share], tokenizer.pad_token_id, *widths))
        losses.append(metrics["loss"])
        if on_step is not None:
            on_step(step, metrics)
    train_s = time.perf_counter() - start - demo_s

    model = learner.model()
    accuracy = teacher_forced_accuracy(model, demos[::max(len(demos) // 256, 1)], tokenizer.pad_token_id)
    out_dir = Path(out_dir)
    save_pretrained(model, out_dir)
    tokenizer.save_pretrained(str(out_dir))
    return {
        "loss_first": losses[0], "loss": losses[-1], **accuracy,
        "demonstrations": len(demos), "steps": cfg.steps,
        "model_tokens": int(sum(sum(t.loss_mask) for t in demos)),
        "demo_s": demo_s, "train_s": train_s, "wall_s": time.perf_counter() - start,
    }


# -- evaluation ---------------------------------------------------------------------------------


async def evaluate_async(engine: Any, tokenizer: Any, specs: Sequence[EnvSpec], env_name: str, episodes: int,
                         split: str = "test", temperature: float = 0.0, pass_k: int = 1, seed: int = 0, *,
                         tasks: Sequence[dict[str, Any]] | None = None,
                         task_fields: dict[str, Any] | None = None, max_tokens: int = 64,
                         max_turns: int = 16, max_total_tokens: int = 1024, success_threshold: float = 1.0,
                         rewards: Sequence[RewardSpec] = (RewardSpec(ENV_REWARD),), tool_parser: str = "qwen",
                         template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """`evaluate` with a running engine, inside an event loop; every episode runs concurrently."""
    by_name = {s.name: s for s in specs}
    if env_name not in by_name:
        raise ValueError(f"evaluate: unknown environment {env_name!r}; envs: {list(by_name)}")
    if episodes < 1 or pass_k < 1:
        raise ValueError(f"evaluate: episodes={episodes} and pass_k={pass_k} must be >= 1")
    spec = in_process_spec(by_name[env_name])
    tasks = list(tasks)[:episodes] if tasks is not None else seed_tasks(spec, episodes, split, seed, task_fields)
    runtime = EnvRuntime([spec], tokenizer, get_parser(tool_parser), list(rewards), template_kwargs)
    await runtime.start()

    async def one(i: int, k: int) -> Trajectory:
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                stop_token_ids=(tokenizer.eos_token_id,), seed=seed + i * pass_k + k)
        return await run_episode(engine, f"eval-{i}", k, [], params, runtime.hook(env_name, tasks[i]),
                                 env=env_name, max_turns=max_turns, max_total_tokens=max_total_tokens)

    start = time.perf_counter()
    try:
        trajs = await asyncio.gather(*(one(i, k) for i in range(len(tasks)) for k in range(pass_k)))
    finally:
        await runtime.aclose()
    reward_TxK = np.array([sum(t.rewards.values()) for t in trajs], np.float64).reshape(len(tasks), pass_k)
    p = float((reward_TxK >= success_threshold).any(1).mean())
    errors = [t.error for t in trajs if t.finish_reason == "error"]
    return {
        "env": env_name, "split": split, "episodes": len(tasks), "pass_k": pass_k,
        "success_rate": p, "success_stderr": math.sqrt(p * (1 - p) / len(tasks)),
        "mean_reward": float(reward_TxK.mean()),
        "mean_turns": float(np.mean([t.num_turns for t in trajs])),
        "mean_model_tokens": float(np.mean([sum(t.loss_mask) for t in trajs])),
        "finish_reasons": dict(Counter(t.finish_reason for t in trajs)),
        "errors": len(errors), "first_error": errors[0] if errors else "",
        "examples": [{"task": tasks[i // pass_k], "reward": float(reward_TxK.flat[i]),
                      "completion": tokenizer.decode(trajs[i].completion_ids)} for i in range(min(3, len(trajs)))],
        "wall_s": time.perf_counter() - start,
    }


def evaluate(model_dir_or_engine: str | Path | Any, specs: Sequence[EnvSpec], env_name: str, episodes: int,
             split: str = "test", temperature: float = 0.0, pass_k: int = 1, seed: int = 0, *,
             tokenizer: Any = None, max_batch: int = 64, **kwargs: Any) -> dict[str, Any]:
    """Held-out success of a policy on `episodes` tasks of `env_name` (greedy by default).

    `model_dir_or_engine`: a Hugging Face model directory (served by an in-process `JaxEngine`,
    closed afterwards) or an engine (then `tokenizer`, or the engine's own, renders prompts).
    Bundled environments draw tasks by seed from `split`; others need `tasks=[reset kwargs, ...]`.
    An episode succeeds when its summed reward reaches `success_threshold` (1.0), a task when any
    of its `pass_k` samples does. Returns `success_rate`, `success_stderr` (sqrt(p(1-p)/n) over
    tasks), `mean_reward`, `episodes` and diagnostics; `kwargs` go to `evaluate_async`.
    """
    owned = isinstance(model_dir_or_engine, (str, Path))
    if owned:
        from transformers import AutoTokenizer

        from bridge.engines.jax_engine import JaxEngine

        tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model_dir_or_engine), local_files_only=True)
        engine = JaxEngine(model_dir_or_engine, max_batch=max_batch, seed=seed, tokenizer=tokenizer)
    else:
        engine = model_dir_or_engine
        tokenizer = tokenizer or getattr(engine, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("evaluate: pass tokenizer= with an engine that has none")

    async def go():
        try:
            return await evaluate_async(engine, tokenizer, specs, env_name, episodes, split, temperature,
                                        pass_k, seed, **kwargs)
        finally:
            if owned:
                await engine.close()

    return asyncio.run(go())
