"""Trajectories to a learner batch: the one path for RL rollouts and warm-start demonstrations.

Prompts are left-padded, completions right-padded; rows beyond the trajectories are padding (every
mask 0, one prompt token to attend to). Widths come from a small bucketed set so that the jitted
step compiles few shapes (`jaxrl.compilation.bucket`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bridge.wire import TrajectoryData
from jaxrl.learner import prompt_widths
from jaxrl.models import ModelConfig, moe
from jaxrl.run.config import TrainConfig
from jaxrl.run.rewards import RewardWeights


def learner_batch(trajs: Sequence[TrajectoryData], rows: int, prompt_len: int, completion_len: int, pad_id: int,
                  rewards: RewardWeights | None = None, sampler_logp: bool = False,
                  mask_truncated: bool = False, teacher_logp: bool = False,
                  model: ModelConfig | None = None) -> dict[str, np.ndarray]:
    """The learner's batch of `rows` rows from `trajs` (at most `rows`).

    `rewards`: one column per reward function (NaN where one does not apply); None: one column of
    zeros (supervised batches need none). `mask_truncated`: episodes cut by the token budget
    keep their row but train no token (DAPO overlong filtering). `teacher_logp`: the distillation
    teacher's logprobs, which every trajectory must carry. Environment tokens past
    `completion_len` (the last tool result of an episode that ran out of budget) are cut; a
    trajectory whose model tokens do not fit is a ValueError, never trained on cut. An MoE `model`'s
    batch carries the routes the sampler recorded (`moe.no_route` where none was: padding, a token never
    fed, an engine that records none).
    """
    if len(trajs) > rows:
        raise ValueError(f"{len(trajs)} trajectories do not fit a batch of {rows} rows")
    R = len(rewards.keys) if rewards is not None else 1
    batch = {
        "prompt_BxP": np.full((rows, prompt_len), pad_id, np.int32),
        "prompt_mask_BxP": np.zeros((rows, prompt_len), np.int32),
        "completion_BxC": np.full((rows, completion_len), pad_id, np.int32),
        "completion_mask_BxC": np.zeros((rows, completion_len), np.int32),
        "loss_mask_BxC": np.zeros((rows, completion_len), np.int32),
        "rewards_BxR": np.zeros((rows, R), np.float32),
    }
    if sampler_logp:
        batch["sampler_logp_BxC"] = np.zeros((rows, completion_len), np.float32)
    if teacher_logp:
        batch["teacher_logp_BxC"] = np.zeros((rows, completion_len), np.float32)
    U = 0 if model is None else model.route_width
    if U:
        dtype, none = moe.route_dtype(model.num_experts), moe.no_route(model.num_experts)
        batch["prompt_routes_BxPxU"] = np.full((rows, prompt_len, U), none, dtype)
        batch["completion_routes_BxCxU"] = np.full((rows, completion_len, U), none, dtype)
    for i, t in enumerate(trajs):
        p, c = len(t.prompt_ids), min(len(t.completion_ids), completion_len)
        if not 0 < p <= prompt_len or t.loss_mask[completion_len:].any():
            raise ValueError(f"trajectory {t.group_id}/{t.index_in_group} ({t.env}) has {p} prompt and "
                             f"{len(t.completion_ids)} completion tokens; the batch holds {prompt_len} and "
                             f"{completion_len} (model tokens), and every trajectory needs a prompt")
        batch["prompt_BxP"][i, prompt_len - p:] = t.prompt_ids
        batch["prompt_mask_BxP"][i, prompt_len - p:] = 1
        batch["completion_BxC"][i, :c] = t.completion_ids[:c]
        batch["completion_mask_BxC"][i, :c] = 1
        if not (mask_truncated and t.finish_reason == "length"):
            batch["loss_mask_BxC"][i, :c] = t.loss_mask[:c]
        if rewards is not None:
            batch["rewards_BxR"][i] = rewards.columns(t.rewards)
        if sampler_logp:
            batch["sampler_logp_BxC"][i, :c] = t.sampler_logprobs[:c]
        if teacher_logp:
            if len(t.teacher_logprobs) != len(t.completion_ids):
                raise ValueError(f"trajectory {t.group_id}/{t.index_in_group} ({t.env}) carries no teacher logprobs: "
                                 "its bridge serves no distillation teacher (set teacher.model, or start it with "
                                 "--teacher)")
            batch["teacher_logp_BxC"][i, :c] = t.teacher_logprobs[:c]
        if U and len(t.routes):
            if t.routes.shape[1] != U or t.routes.max(initial=0) >= model.num_experts:
                raise ValueError(f"trajectory {t.group_id}/{t.index_in_group} ({t.env}) carries routes of "
                                 f"{t.routes.shape[1]} expert ids a token, up to {t.routes.max()}; the model routes "
                                 f"{U} a token over {model.num_experts} experts: its bridge serves another model")
            fed = len(t.routes)
            batch["prompt_routes_BxPxU"][i, prompt_len - p:prompt_len - p + min(fed, p)] = t.routes[:p]
            batch["completion_routes_BxCxU"][i, :max(0, min(fed - p, c))] = t.routes[p:p + c]
    batch["prompt_mask_BxP"][len(trajs):, -1] = 1  # padding rows still need one token to attend to
    return batch


def rl_batch(trajs: Sequence[TrajectoryData], cfg: TrainConfig, pad_id: int, rows: int | None = None,
             prompt_len: int | None = None, model: ModelConfig | None = None) -> dict[str, np.ndarray]:
    """A training step's batch as `cfg` shapes it: groups_per_step x group_size rows (or `rows`, a
    process's share of them; rows beyond `trajs` are padding), prompts `prompt_width` wide (one of a
    few widths fixed by the config; a prompt longer than `rollout.max_prompt_tokens` widens its step;
    `prompt_len` when the processes of a run agreed on one), completions `rollout.max_total_tokens`
    wide, rewards weighed by `rewards[]`, sampler logprobs when the loss corrects by importance
    sampling (and, of an MoE `model`, always: its metrics compare learner and sampler), the routes the
    sampler recorded for an MoE `model`."""
    prompt_len = prompt_width(trajs, cfg) if prompt_len is None else prompt_len
    routed = model is not None and model.route_width > 0
    return learner_batch(trajs, cfg.groups_per_step_rows if rows is None else rows, prompt_len,
                         cfg.rollout.max_total_tokens, pad_id, RewardWeights(cfg.rewards),
                         sampler_logp=cfg.learner.loss.needs_sampler_logp or routed,
                         mask_truncated=cfg.rollout.drop_truncated, teacher_logp=cfg.learner.loss.distill_weight > 0,
                         model=model)


def learner_widths(cfg: TrainConfig) -> tuple[int, ...]:
    """The prompt widths of the run's batches (`jaxrl.learner.prompt_widths`; `learner.prompt_widths` null: one
    per 128 tokens of the widest, at most 4, as experiments/bench/vs_trl.py measured fastest); packed, one: the model
    runs on real tokens whatever the padded layout's width."""
    widest = cfg.rollout.max_prompt_tokens
    if widest is None:
        raise ValueError("rollout.max_prompt_tokens is null: a run sizes it from its environments' first prompts "
                         "when it starts them; set it for batches built without a run")
    steps = cfg.learner.prompt_widths or min(4, max(1, widest // 128))
    return (widest,) if cfg.learner.pack_tokens is not None else prompt_widths(widest, steps)


def prompt_width(trajs: Sequence[TrajectoryData], cfg: TrainConfig) -> int:
    """The prompt width `trajs` need: the narrowest of `learner_widths` that holds their longest
    prompt, or that prompt's length when it is longer than `rollout.max_prompt_tokens`."""
    longest = max((len(t.prompt_ids) for t in trajs), default=1)
    return next((w for w in learner_widths(cfg) if w >= longest), longest)
