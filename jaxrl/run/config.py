"""The training config: every key of `jaxrl train`, with its default and what it means.

`jaxrl config` prints this file's defaults as commented YAML. A YAML config (or a gin file: see
jaxrl.run.gin_config) sets only what differs; `--set dotted.key=value` (or `--gin 'Class.key = value'`)
overrides on the command line. The resolved config is saved as
`config.yaml` in the run directory. Keys the run derives from others (`DERIVED`) are not user
keys: setting one is an error naming the key to set instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from bridge.envs.spec import BUNDLED_NAMES, ENV_REWARD, EnvSpec, RewardSpec
from bridge.wire import SamplingParams
from jaxrl.options import option
from jaxrl.sharding import MeshConfig
from jaxrl.snapshot_store import check_location
from jaxrl.train_step import LearnerConfig
from jaxrl.run.gin_config import gin_overrides
from jaxrl.run.typed_config import ConfigError, apply_overrides, load

@dataclasses.dataclass(frozen=True)
class TinyModelConfig:
    family: Literal["qwen3", "qwen2", "llama", "qwen3_moe", "gpt_oss"] = option(
        "architecture of the tiny model (qwen3_moe, gpt_oss: a mixture of experts in every layer)", default="qwen3")
    hidden_size: int = option("width", default=64)
    intermediate_size: int = option("MLP width (gpt_oss: its experts', moe_intermediate_size)", default=128)
    num_layers: int = option("layers", default=2)
    seed: int = option("initialisation seed", default=0)
    num_experts: int = option("experts of each MoE layer (an MoE family's)", default=8)
    num_experts_per_tok: int = option("experts each token goes to (an MoE family's)", default=2)
    moe_intermediate_size: int = option("each expert's MLP width (an MoE family's)", default=32)

    def model_fields(self) -> dict:
        """The `jaxrl.tiny.tiny_config` fields this tiny model sets."""
        fields = {"hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                  "num_layers": self.num_layers}
        if self.family in ("qwen3_moe", "gpt_oss"):
            fields |= {"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                       "moe_intermediate_size": self.moe_intermediate_size}
        if self.family == "gpt_oss":  # config.json's intermediate_size is its experts' width
            fields["intermediate_size"] = self.moe_intermediate_size
        return fields


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    dir: str = option("Hugging Face model directory (config.json, safetensors, tokenizer)")
    tiny: TinyModelConfig | None = option(
        "build a random tiny model with the bundled tokenizer in `dir` when it does not exist (the CPU default; "
        "nothing is downloaded)", default=None)
    dtype: Literal["float32", "bfloat16"] = option("learner parameter dtype", default="float32")


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
    model: str = option(
        "Hugging Face model directory of the teacher (the student's tokenizer): the run's bridges score every episode "
        "with it, and learner.loss.distill_weight turns its logprobs into each token's advantage")


@dataclasses.dataclass(frozen=True)
class BridgeConfig:
    addresses: list[str] = option(
        "running bridges (host:port); empty: start per_host for this run; several: groups go to the least loaded, and "
        "a bridge that stops answering has its unfinished groups requested from the others. Each needs its token "
        "(token_file), the run's snapshot directory under its --snapshot-root, and serves a version no newer than the "
        "run's first (versions on a bridge only go forward: a new run, a new bridge)", default_factory=list)
    token_file: str | None = option(
        "file holding the token of the bridges at `addresses` (their `jaxrl bridge --token-file`); null: "
        "$JAXRL_BRIDGE_TOKEN. Bridges the run starts get a fresh token of its own", default=None)
    tls_ca: str | None = option(
        "PEM certificate authority to verify the bridges at `addresses` over TLS (their --tls-cert, or its issuer); "
        "null: plain connections", default=None)
    engine: Literal["jax", "vllm"] = option("generation engine of a started bridge", default="jax")
    engine_kwargs: dict[str, Any] = option("passed to the engine (vllm.LLM arguments for vllm)", default_factory=dict)
    max_batch: int | None = option("most sequences the engine generates together", default=None)
    start_timeout_s: float = option("how long a started bridge may take to serve", default=300.0)
    request_timeout_s: float | None = option(
        "a rollout request that takes longer is an error; null: as long as an episode may take with its replays (twice "
        "envs[].episode_timeout_s plus retry_budget_s, the longest of them) and a minute; no limit when an environment "
        "has no episode_timeout_s", default=None)
    tool_parser: str = option("tool-call format of the model family (qwen, hermes)", default="qwen")
    chat_template_kwargs: dict[str, Any] = option(
        "extra chat-template arguments, e.g. enable_thinking: false", default_factory=dict)
    per_host: int = option(
        "bridges the run starts on each host when `addresses` is empty, each its own process (with `devices`, its own "
        "GPUs); groups go to the least loaded", default=1)
    devices: list[str] = option(
        "the GPUs of each started bridge, one entry per bridge (per_host of them), given to it as "
        "CUDA_VISIBLE_DEVICES, e.g. ['0,1', '2,3'] for two vLLM bridges of two GPUs each; empty: every bridge sees "
        "every device", default_factory=list)
    cpus: list[int] = option(
        "the CPUs the started bridges run on (e.g. [0] beside a trainer started with `taskset -c 1`, so that "
        "generation and learning do not take each other's cores); empty: the trainer's", default_factory=list)
    health_timeout_s: float = option(
        "a bridge that does not answer a health check (or a ping while it streams) within this is dead: its unfinished "
        "groups are requested again from the others", default=10.0)
    max_restarts: int = option(
        "a started bridge that dies is restarted (and given the newest snapshot) at most this many times within 10 "
        "minutes; after that it is left down", default=3)
    grace_s: float = option(
        "the run fails when no bridge has served for this long (none alive, none restarted meanwhile), naming the "
        "bridges that died and why", default=600.0)

    def __post_init__(self):
        if self.per_host < 1:
            raise ValueError(f"per_host={self.per_host} must be >= 1")
        if self.devices and len(self.devices) != self.per_host:
            raise ValueError(f"devices lists {len(self.devices)} device group(s) but per_host={self.per_host}: "
                             "give one per bridge, or none")
        if self.health_timeout_s <= 0 or self.max_restarts < 0 or self.grace_s < 0:
            raise ValueError("health_timeout_s must be > 0, max_restarts and grace_s >= 0")
        if any(not isinstance(c, int) or c < 0 for c in self.cpus):
            raise ValueError(f"cpus={self.cpus} must be CPU numbers (integers >= 0), e.g. [0]")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    train_file: str | None = option(
        "JSON lines of training tasks ({\"env\": name, ...task fields}, or a TRL dataset's rows: prompt + columns; env "
        "may be left out with one environment); default: tasks drawn by seed from each environment (bundled ones: "
        "their train split)", default=None)
    eval_file: str | None = option(
        "JSON lines of held-out tasks; default: seeds of the bundled test split, or seeds past the training ones",
        default=None)
    mix: dict[str, float] = option(
        "environment name -> share of seed-drawn training tasks (default: equal)", default_factory=dict)
    task_fields: dict[str, dict[str, Any]] = option(
        "environment name -> task fields added to every seed-drawn task (e.g. max_steps)", default_factory=dict)
    splits: dict[str, dict[str, str]] = option(
        "environment name -> {train: SPLIT, eval: SPLIT}: its tasks come from its own task routes (openenv >= 0.10 "
        "servers or env_class environments with list_splits / num_tasks): task {split, index}, training indices drawn "
        "by seed, evaluation on the eval split's first eval.episodes", default_factory=dict)
    seed: int = option("order of the training tasks", default=0)

    def __post_init__(self):
        for env, splits in self.splits.items():
            if not isinstance(splits, dict) or set(splits) != {"train", "eval"} or not all(
                    isinstance(v, str) and v for v in splits.values()):
                raise ValueError(f"data.splits.{env} must be {{train: SPLIT, eval: SPLIT}} (the server's split "
                                 f"names; `jaxrl env tasks URL` lists them), got {splits!r}")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    mode: Literal["sync", "async", "stream"] = option(
        "sync: generate, then learn; async: the bridge generates the next batch while the learner trains; stream: "
        "in_flight_groups groups always under way, a step takes the first to complete and episodes go on across weight "
        "updates (async and stream: importance-sampling corrected, stale groups dropped)", default="sync")
    in_flight_groups: int = option(
        "stream: groups under way at once (each learner.group_size episodes); 0: two steps' worth", default=0)
    groups_per_step: int = option("tasks per training step (each sampled learner.group_size times)", default=8)
    temperature: float = option("sampling temperature (the learner takes logprobs at the same)", default=1.0)
    top_p: float = option("nucleus sampling (vLLM refuses < 1: logprobs would not match)", default=1.0)
    max_tokens: int = option("tokens per model turn", default=64)
    max_turns: int = option("model turns per episode", default=1)
    max_total_tokens: int = option("all turns of an episode, environment tokens included", default=256)
    max_prompt_tokens: int | None = option(
        "longest episode prompt (task prompt and the environment's first observation): the learner batch's prompt "
        "width (the widest of learner.prompt_widths), and a started jax engine holds max_prompt_tokens + "
        "max_total_tokens per sequence; null: sized at start from each environment's first prompt (a quarter more "
        "than the longest, rounded up to 64 tokens; `jaxrl env prompt` shows one; 512 where every environment builds "
        "its own prompts)", default=None)
    max_staleness: int = option(
        "async, stream: drop groups with a token more than this many versions older than the learner", default=1)
    dynamic_sampling: bool = option("DAPO: drop groups whose rewards are all equal and refill", default=False)
    max_refills: int = option("dynamic sampling: extra requests per step at most", default=4)
    drop_truncated: bool = option("drop episodes cut by the token budget (finish_reason length)", default=False)
    min_success_fraction: float = option(
        "stop with an error when fewer episodes than this succeed in a step (environments down)", default=0.25)
    max_unscored_steps: int = option(
        "stop with an error after this many steps in a row in which no reward function scored any episode (all "
        "returned None)", default=3)

    def __post_init__(self):
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"rollout.max_prompt_tokens={self.max_prompt_tokens} must be >= 1 (null: sized from the "
                             "environments' first prompts)")
        if self.groups_per_step < 1:
            raise ValueError(f"rollout.groups_per_step={self.groups_per_step} must be >= 1")
        if self.max_total_tokens < self.max_tokens:
            raise ValueError(f"rollout: max_total_tokens >= max_tokens (got {self.max_total_tokens} < "
                             f"{self.max_tokens})")
        if self.max_unscored_steps < 1:
            raise ValueError(f"rollout.max_unscored_steps={self.max_unscored_steps} must be >= 1")
        if not 0 <= self.min_success_fraction <= 1 or self.max_staleness < 0 or self.max_refills < 0:
            raise ValueError("rollout: min_success_fraction must be in [0, 1], max_staleness and max_refills >= 0")
        if not 0 < self.temperature < math.inf:  # NaN included
            raise ValueError(f"rollout.temperature={self.temperature} must be a finite number > 0 (greedy is for "
                             "evaluation)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.top_p} must be in (0, 1] (1: no top-p)")
        if self.in_flight_groups < 0:
            raise ValueError(f"rollout.in_flight_groups={self.in_flight_groups} must be >= 0 (0: two steps' worth)")
        self.sampling()  # SamplingParams checks the rest (max_tokens, max_turns, ...): bad ones stop the load

    def sampling(self, **settings) -> SamplingParams:
        """Each turn's sampling settings and the episode's limits, as they travel to the bridge's
        episodes; `settings` replace or add some (evaluation's temperature, the stop ids, the seed)."""
        return SamplingParams(**{"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens,
                                 "max_turns": self.max_turns, "max_total_tokens": self.max_total_tokens, **settings})


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every: int = option("evaluate every N steps (0: only before and after training)", default=0)
    episodes: int = option("held-out episodes per evaluation", default=64)
    temperature: float = option("0: greedy", default=0.0)
    pass_k: int = option("samples per task; success if any succeeds (pass@k)", default=1)
    before: bool = option("evaluate before training (after the warm start's start point)", default=True)
    success_threshold: float = option("an episode succeeds when its summed reward reaches this", default=1.0)

    def __post_init__(self):
        if self.episodes < 0 or self.pass_k < 1 or not 0 <= self.temperature < math.inf or self.every < 0:
            raise ValueError("eval: episodes and every must be >= 0, pass_k >= 1, temperature finite and >= 0")
        if self.pass_k > 1 and self.temperature == 0:
            raise ValueError("eval.pass_k > 1 needs eval.temperature > 0 (greedy samples are all the same)")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    steps: int = option("supervised warm-start steps on solver demonstrations (0: none)", default=0)
    batch_size: int = option("demonstrations per step", default=32)
    learning_rate: float = option(
        "warm-start peak learning rate (learner.optimizer's AdamW settings, warmup over a tenth of the steps, then "
        "cosine decay to 10%)", default=3e-3)
    demonstrations: int = option("solver episodes the bridge plays (training tasks)", default=1024)
    envs: list[str] = option(
        "environments to demonstrate (default: every environment of the run with a solver)", default_factory=list)
    train_all: bool | None = option(
        "with learner.lora: the warm start trains every weight, and RL then trains adapters over the warm-started "
        "model (written to RUN/base-model, which the run's bridges are restarted on and its adapters name as their "
        "base); false: the warm start trains the adapters alone; null: true for a model.tiny model (random: its frozen "
        "head leaves adapters nothing to adapt), false otherwise", default=None)

    def __post_init__(self):
        if self.steps < 0 or self.batch_size < 1 or self.demonstrations < 1:
            raise ValueError("sft: steps must be >= 0, batch_size and demonstrations >= 1")


@dataclasses.dataclass(frozen=True)
class LogConfig:
    tensorboard: bool = option("write TensorBoard event files in the run directory", default=True)
    wandb: dict[str, Any] | None = option("Weights & Biases `wandb.init` arguments; null: off", default=None)
    samples_per_step: int = option("completions written to samples.jsonl per step", default=2)
    progress: bool = option("show a progress bar", default=True)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """One run over several processes (hosts): see jaxrl.run.distributed. Launch settings, not the run's:
    a run resumes on another process count, and config.yaml keeps none of them."""

    coordinator: str | None = option(
        "host:port of process 0's jax.distributed coordinator (every process gives the same); null: the one the "
        "cluster environment gives (SLURM, Open MPI, TPU pods), else one process", default=None)
    num_processes: int | None = option(
        "processes in the run (flag --num-processes); null: from the cluster environment", default=None)
    process_id: int | None = option(
        "this process's index, 0 to num_processes - 1 (flag --process-id); null: from the cluster environment",
        default=None)
    auto: bool = option(
        "initialise jax.distributed when the cluster environment (SLURM, Open MPI, a TPU pod) says the run has more "
        "than one process; false: one process unless coordinator or num_processes is set", default=True)
    timeout_s: int = option(
        "how long a process waits for the others: at start-up, and for their share of a step (process 0's evaluations "
        "included: it alone evaluates)", default=1800)

    def __post_init__(self):
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"distributed.num_processes={self.num_processes} must be >= 1")
        if self.process_id is not None and not (
                0 <= self.process_id < (self.num_processes if self.num_processes is not None else 2 ** 31)):
            raise ValueError(f"distributed.process_id={self.process_id} must be in [0, num_processes="
                             f"{self.num_processes})")
        if self.coordinator is not None and ":" not in self.coordinator:
            raise ValueError(f"distributed.coordinator={self.coordinator!r} must be host:port")
        if self.timeout_s < 1:
            raise ValueError(f"distributed.timeout_s={self.timeout_s} must be >= 1")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    run_dir: str = option("where checkpoints, snapshots, metrics and plots go")
    model: ModelConfig = option("the policy model")
    envs: list[EnvSpec] = option("environments (name + one of bundled / url / env_class / rollout_fn / harness); see "
                                 "bridge.envs.spec")
    steps: int = option("training steps (one batch each)", default=100)
    seed: int = option(
        "the run's seed: every episode samples with seeds derived from it and the episode's step, group and index; it "
        "also picks demonstrations and orders the warm start (tasks: data.seed)", default=0)
    rewards: list[RewardSpec] = option(
        "reward functions fn(prompts, completions, completion_ids, environments, **task_fields) -> list[float | None] "
        "(TRL's reward functions unchanged), 'env' (the environment's own reward: a tool class's get_reward() or "
        "reward()), or reward models the bridges serve ({model: DIR, kind: classifier}; {kind: judge, model: DIR or "
        "judge: policy, template: ...}), with weights", default_factory=lambda: [RewardSpec(ENV_REWARD)])
    data: DataConfig = option("tasks", default_factory=DataConfig)
    rollout: RolloutConfig = option("generation", default_factory=RolloutConfig)
    learner: LearnerConfig = option(
        "loss, advantages, optimizer (group_size lives here)", default_factory=LearnerConfig)
    mesh: MeshConfig = option("learner device mesh", default_factory=MeshConfig)
    bridge: BridgeConfig = option("generation", default_factory=BridgeConfig)
    eval: EvalConfig = option("held-out evaluation", default_factory=EvalConfig)
    sft: SFTConfig = option("supervised warm start before RL", default_factory=SFTConfig)
    teacher: TeacherConfig | None = option(
        "on-policy distillation: {model: DIR}, with learner.loss.distill_weight > 0; null: none", default=None)
    log: LogConfig = option("what the run shows and writes", default_factory=LogConfig)
    distributed: DistributedConfig = option("several processes (hosts) in one run", default_factory=DistributedConfig)
    sync_every: int = option("publish weights to the bridge every N steps", default=1)
    snapshot_dir: str | None = option(
        "where weight snapshots go while the run trains (every bridge must read it): a directory, or a gs:// or s3:// "
        "URL (the bucket's credentials and endpoint come from the environment, as for Google's and AWS's tools); null: "
        "a directory of the run's own in /dev/shm (memory, removed at the end) when the run starts its bridges on one "
        "host and its snapshots fit in half the memory free there, else RUN/snapshots. Outside RUN/snapshots, the last "
        "snapshot served is copied there at the end (for `jaxrl eval`, `jaxrl export`)", default=None)
    checkpoint_every: int = option("train checkpoint every N steps (and at the end)", default=25)
    keep_checkpoints: int = option("train checkpoints kept", default=2)
    compilation_cache: str | None = option(
        "JAX's persistent compilation cache for the learner and the bridges the run starts (a second run of the same "
        "config compiles nothing); null: off", default="~/.cache/jaxrl/xla")

    # dotted key -> what the run derives it from (see `learner_config`)
    DERIVED: ClassVar[dict[str, str]] = {
        "learner.temperature": "rollout.temperature",
        "learner.advantages.reward_weights": "rewards[].weight",
        "learner.optimizer.total_steps": "steps x learner.num_iterations",
    }

    def __post_init__(self):
        positive = ("steps", "sync_every", "checkpoint_every", "keep_checkpoints")
        for key in positive:
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)!r} must be >= 1")
        if "://" in str(self.run_dir):
            raise ValueError(f"run_dir={self.run_dir!r}: a URL; a run directory is a POSIX one (shared by the hosts of "
                             "a multi-host run): mount the bucket (e.g. gcsfuse) and give the mount's path")
        if self.snapshot_dir is not None:
            try:
                check_location(self.snapshot_dir)
            except ValueError as e:
                raise ValueError(f"snapshot_dir: {e}") from None
        if not self.envs:
            raise ValueError("envs: list at least one environment")
        names = [e.name for e in self.envs]
        if len(set(names)) != len(names):
            raise ValueError(f"envs: names must be unique, got {names}")
        data = self.data
        for key, where in (("mix", data.mix), ("task_fields", data.task_fields), ("splits", data.splits)):
            unknown = sorted(set(where) - set(names))
            if unknown:
                raise ValueError(f"data.{key} names unknown environment(s) {unknown}; envs: {names}")
        unknown = sorted(set(self.sft.envs) - set(names))
        if unknown:
            raise ValueError(f"sft.envs names unknown environment(s) {unknown}; envs: {names}")
        keys = [r.key for r in self.rewards]
        if not keys or len(set(keys)) != len(keys):
            raise ValueError(f"rewards: need at least one, with distinct names; got {keys}")
        r = self.rollout
        if r.mode != "sync" and self.learner.loss.is_level == "none":
            raise ValueError(f"rollout.mode={r.mode} trains on trajectories of older weights: set "
                             "learner.loss.is_level to token or sequence (importance-sampling correction)")
        pack = self.learner.pack_tokens
        if pack is not None and r.max_prompt_tokens is not None and pack < r.max_prompt_tokens + r.max_total_tokens:
            raise ValueError(f"learner.pack_tokens={pack} is shorter than an episode may be (rollout.max_prompt_tokens "
                             f"+ max_total_tokens = {r.max_prompt_tokens + r.max_total_tokens}): raise it to at least "
                             "that")
        if (self.groups_per_step_rows % self.learner.grad_accum) != 0:
            raise ValueError(f"rollout.groups_per_step x learner.group_size = {self.groups_per_step_rows} must be "
                             f"divisible by learner.grad_accum={self.learner.grad_accum}")
        no_solver = [e.name for e in self.envs if e.name in self.sft.envs and e.solver is None]
        if self.sft.steps and no_solver:
            raise ValueError(f"sft.envs names environment(s) {no_solver} without a solver; set their solver: "
                             f"(one of {', '.join(BUNDLED_NAMES)}) or leave them out")
        if self.sft.steps and not self.sft.envs and not any(e.solver for e in self.envs):
            raise ValueError("sft.steps > 0 but no environment has a solver to play demonstrations; bundled "
                             "environments have one (or set an environment's solver:)")
        longest, timeout = self.longest_episode_s, self.bridge.request_timeout_s
        if timeout is not None and longest is not None and timeout < longest:
            raise ValueError(f"bridge.request_timeout_s={timeout:g} is shorter than an episode may take with its "
                             f"replays ({longest:g} s: twice envs[].episode_timeout_s, plus retry_budget_s); "
                             "raise it, or leave it null")
        self._check_lora()
        self._check_train_all()
        self._check_teacher()
        self._check_reward_models()
        self.learner_config()  # the derived values must make a valid learner config

    def _check_lora(self) -> None:
        """LoRA needs the engine to serve adapters: the run tells it (no engine_kwargs of its own)."""
        lora, kwargs = self.learner.lora, self.bridge.engine_kwargs
        if lora is None:
            return
        if "lora" in kwargs:
            raise ValueError("bridge.engine_kwargs.lora: the run sets it from learner.lora; leave it out")
        if self.bridge.engine == "vllm" and kwargs.get("enable_lora", True) is not True:
            raise ValueError("learner.lora needs vLLM's LoRA support: leave bridge.engine_kwargs.enable_lora out "
                             "(the run turns it on), or set learner.lora: null")
        if self.bridge.engine == "vllm" and kwargs.get("max_lora_rank", lora.rank) < lora.rank:
            raise ValueError(f"bridge.engine_kwargs.max_lora_rank={kwargs['max_lora_rank']} is below "
                             f"learner.lora.rank={lora.rank}: raise it, or leave it out (the run sets it)")

    def _check_reward_models(self) -> None:
        """A reward model's directory is there (the bridges load it; a missing one fails before minutes of
        loading)."""
        for i, r in enumerate(self.rewards):
            if r.model is not None and not (Path(r.model).expanduser() / "config.json").is_file():
                raise ValueError(f"rewards[{i}] ({r.key}): model {r.model!r} is not a model directory (no "
                                 "config.json); give a Hugging Face directory of safetensors and its tokenizer")

    def _check_teacher(self) -> None:
        """A teacher and a distillation weight come together."""
        weight = self.learner.loss.distill_weight
        if weight > 0 and self.teacher is None:
            raise ValueError(f"learner.loss.distill_weight={weight:g} needs a teacher: set teacher.model to the "
                             "teacher's model directory")
        if self.teacher is not None and weight == 0:
            raise ValueError("teacher is set but learner.loss.distill_weight is 0: set it > 0 (e.g. 1.0) to distill, "
                             "or leave teacher out")

    def _check_train_all(self) -> None:
        """sft.train_all picks what a LoRA run's warm start trains: set, it needs both."""
        if self.sft.train_all is not None and self.learner.lora is None:
            raise ValueError(f"sft.train_all={str(self.sft.train_all).lower()} applies to LoRA runs: without "
                             "learner.lora the warm start trains every weight already; leave it out")
        if self.sft.train_all is not None and not self.sft.steps:
            raise ValueError(f"sft.train_all={str(self.sft.train_all).lower()} with sft.steps=0: there is no warm "
                             "start to train; set sft.steps, or leave sft.train_all out")
        if self.full_warm_start and self.bridge.addresses:
            raise ValueError("sft.train_all (true for a model.tiny model) restarts the bridges on the warm-started "
                             "model, which bridge.addresses cannot: leave them empty, or set sft.train_all: false")

    @property
    def full_warm_start(self) -> bool:
        """A LoRA run whose warm start trains every weight: its adapters sit on the warm-started model
        (RUN/base-model), not on model.dir."""
        train_all = self.sft.train_all if self.sft.train_all is not None else self.model.tiny is not None
        return self.learner.lora is not None and self.sft.steps > 0 and train_all

    @property
    def longest_episode_s(self) -> float | None:
        """The longest an episode may take with its replays: its first attempt and a last replay started
        within retry_budget_s of the first loss, each bounded by episode_timeout_s; None when one is not."""
        bounds = [None if e.episode_timeout_s is None else 2 * e.episode_timeout_s + e.retry_budget_s
                  for e in self.envs]
        return None if None in bounds else max(bounds)

    @property
    def rollout_timeout_s(self) -> float | None:
        """The deadline of a rollout request: bridge.request_timeout_s, or a minute past longest_episode_s."""
        if self.bridge.request_timeout_s is not None:
            return self.bridge.request_timeout_s
        return None if self.longest_episode_s is None else self.longest_episode_s + 60.0

    def sampling_params(self, stop_ids: tuple[int, ...], evaluation: bool = False) -> SamplingParams:
        """How training episodes sample and how long they run, or held-out ones (`eval.temperature`, no
        top-p); seeded by the run seed, so the same run samples the same episodes."""
        if evaluation:
            return self.rollout.sampling(temperature=self.eval.temperature, top_p=1.0, stop_token_ids=stop_ids,
                                         seed=self.seed)
        return self.rollout.sampling(stop_token_ids=stop_ids, seed=self.seed)

    @property
    def streamed_groups(self) -> int:
        """Stream mode: the groups under way at once (0 in the other modes)."""
        r = self.rollout
        return (r.in_flight_groups or 2 * r.groups_per_step) if r.mode == "stream" else 0

    @property
    def groups_per_step_rows(self) -> int:
        return self.rollout.groups_per_step * self.learner.group_size

    @property
    def reward_keys(self) -> list[str]:
        return [r.key for r in self.rewards]

    def learner_config(self) -> LearnerConfig:
        """The learner settings with the values the run derives (`DERIVED`) filled in."""
        lc = self.learner
        return dataclasses.replace(
            lc, temperature=self.rollout.temperature,
            advantages=dataclasses.replace(lc.advantages, reward_weights=tuple(r.weight for r in self.rewards)),
            optimizer=dataclasses.replace(lc.optimizer, total_steps=self.steps * lc.num_iterations))


def load_config(path: str | Path | Mapping[str, Any], overrides: list[str] = (),
                gin_bindings: Sequence[str] = ()) -> TrainConfig:
    """The resolved training config from a YAML or gin (`.gin`) file, or a mapping of its keys; then
    `gin_bindings` (`--gin`, gin syntax) and `overrides` (`--set` items or (dotted key, value) pairs)
    applied in that order; ConfigError (one line naming the key) when it is wrong."""
    if isinstance(path, (str, Path)) and Path(path).suffix == ".gin":
        data = apply_overrides({}, gin_overrides([path], gin_bindings, TrainConfig))
        try:
            return load(TrainConfig, data, overrides)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    pairs = gin_overrides([], gin_bindings, TrainConfig) if gin_bindings else []
    return load(TrainConfig, path, [*pairs, *overrides])


__all__ = ["ConfigError", "TrainConfig", "load_config"]
