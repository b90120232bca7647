"""The TRL half of `experiments.bench.vs_trl`: TRL's GRPOTrainer on the guess-the-number workload.

Runs in `.venv-trl` (`bash scripts/setup_trl.sh`), started by the bench as

    .venv-trl/bin/python experiments/bench/vs_trl_trl_side.py --model DIR --tasks FILE [...]

with the repository root on PYTHONPATH (for `experiments.bench.guess_env`, the environment class
and reward function jaxrl uses too). jaxrl is not imported here. The last stdout line is one JSON
object: per-step rows and start-up times, which the bench turns into medians.

How the phases are timed (TRL 1.16 logs `step_time` = `training_step`, and its `profiling/...`
timings only go to W&B / MLflow / Trackio, so we time the same methods ourselves):

- step: `on_step_begin` -> `on_step_end` (generation, tools, rewards, advantages, forward/backward,
  gradient clipping, the optimizer step; not the dataloader fetch nor logging);
- generate: every `_generate_single_turn` call (the first turn and each turn after tool results);
- rollout: `_generate` (generation + the tool loop: parsing, tool calls, re-tokenizing) plus
  `_calculate_rewards`; tools = rollout - generate (jaxrl's env share likewise includes rewards);
- learn: step - rollout (advantages, the loss forward/backward, clipping, the optimizer step);
- sync: 0 by construction: without vLLM TRL generates with the training model itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

T_LAUNCH = time.time()

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="Hugging Face model directory (the primed tiny model)")
    ap.add_argument("--tasks", required=True, help="JSON lines of task rows ({'seed': k}), in order")
    ap.add_argument("--out", required=True, help="scratch directory for the trainer")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=1, help="prompts (groups) per step")
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-completion-length", type=int, default=128)
    ap.add_argument("--max-tool-calls", type=int, default=4, help="max_tool_calling_iterations")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from experiments.bench.guess_env import GuessNumber, reward

    t_imported = time.time()
    # Rows in TRL's dataset format (a `prompt` of chat messages and the columns reset() reads).
    dataset = Dataset.from_list([json.loads(line) for line in open(args.tasks) if line.strip()])

    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    # TRL only knows the response formats of chat templates it recognises (`add_response_schema`); the tiny
    # template writes Qwen's <tool_call> JSON, so we give it Qwen3's response template ourselves.
    tokenizer.response_template = qwen3_template
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, local_files_only=True)

    batch = args.prompts * args.generations
    config = GRPOConfig(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=batch,  # one optimizer step per generation batch
        gradient_accumulation_steps=1,
        num_generations=args.generations,
        max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=args.max_tool_calls,
        temperature=args.temperature,
        top_p=1.0,
        loss_type="dapo",
        beta=0.0,
        num_iterations=1,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        fp16=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    t = {"generate": 0.0, "rollout": 0.0}
    episodes: list[dict] = []  # this step's: tokens and tool calls per episode

    def timed(fn, key):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                t[key] += time.perf_counter() - t0
        return wrapper

    trainer = GRPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                          environment_factory=GuessNumber, reward_funcs=[reward])

    gen_single, generate, tool_loop, rewards_fn = (trainer._generate_single_turn, trainer._generate,
                                                   trainer._tool_call_loop, trainer._calculate_rewards)
    # Private methods of TRL 1.16's GRPOTrainer (wrapped on the instance; a rename upstream fails loudly here).
    trainer._generate_single_turn = timed(gen_single, "generate")
    trainer._calculate_rewards = timed(rewards_fn, "rollout")
    tool_calls: list[int] = []
    tool_failures: list[int] = []
    open_tag = tokenizer.convert_tokens_to_ids("<tool_call>")
    ends = {tokenizer.eos_token_id, tokenizer.pad_token_id}

    def counting_tool_loop(*a, **kw):
        out = tool_loop(*a, **kw)
        # (tool_mask, completions, completion_ids, logprobs, tool_call_count, tool_failure_count, tool_images)
        tool_calls.append(out[4])
        tool_failures.append(out[5])
        return out

    def recording_generate(prompts):
        t0 = time.perf_counter()
        out = generate(prompts)
        t["rollout"] += time.perf_counter() - t0
        prompt_ids, completion_ids, tool_mask, completions = out[0], out[1], out[2], out[3]
        for i, ids in enumerate(completion_ids):
            mask = tool_mask[i] if tool_mask is not None else [1] * len(ids)
            turns = [m for m in completions[i] if m.get("role") == "assistant"]
            episodes.append({"prompt": len(prompt_ids[i]), "total": len(ids), "model": sum(mask), "turns": len(turns),
                             # <tool_call> tags the model wrote: calls made + calls TRL could not parse
                             "tags": sum(1 for tid, m in zip(ids, mask) if m and tid == open_tag),
                             # ended at the token budget: its last turn cut, or a call whose result did not fit
                             # (TRL drops it) before the tool-call limit
                             "capped": bool(ids) and (ids[-1] not in ends or (
                                 bool(turns and turns[-1].get("tool_calls")) and len(turns) <= args.max_tool_calls))})
        return out

    trainer._tool_call_loop = counting_tool_loop
    trainer._generate = recording_generate

    steps: list[dict] = []
    marks: dict[str, float] = {}

    logged: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            marks.setdefault("first_step_begin", time.time())
            marks["begin"] = time.perf_counter()
            t["generate"] = t["rollout"] = 0.0
            episodes.clear()
            tool_calls.clear()
            tool_failures.clear()

        def on_step_end(self, a, state, control, **kw):
            step_s = time.perf_counter() - marks["begin"]
            n = max(len(episodes), 1)
            steps.append({
                "step": state.global_step, "time": time.time(), "step_s": step_s, "rollout_s": t["rollout"],
                "generate_s": t["generate"], "env_s": t["rollout"] - t["generate"],
                "learn_s": step_s - t["rollout"], "sync_s": 0.0,
                "episodes": len(episodes), "tool_calls": sum(tool_calls) / n,
                # calls that raised, plus <tool_call> tags that never became a call (TRL then ends the episode,
                # taking the turn as the final answer; jaxrl answers it with an error and goes on)
                "tool_errors": (sum(tool_failures) + max(0, sum(e["tags"] for e in episodes) - sum(tool_calls))) / n,
                "model_tokens": sum(e["model"] for e in episodes) / n,
                "total_tokens": sum(e["total"] for e in episodes) / n,
                "prompt_tokens": sum(e["prompt"] for e in episodes) / n,
                "turns": sum(e["turns"] for e in episodes) / n,
                "capped": sum(e["capped"] for e in episodes) / n,
            })

        def on_log(self, a, state, control, logs=None, **kw):
            logged.append(dict(logs or {}))

    trainer.add_callback(Timer())
    trainer.train()
    t_end = time.time()
    own = iter(r for r in logged if "reward" in r)  # TRL's own per-step metrics (logging_steps=1), in order
    for s in steps:
        row = next(own, {})
        s["reward_mean"] = row.get("reward")
        s["trl_tools_call_frequency"] = row.get("tools/call_frequency")
        s["trl_completions_mean_length"] = row.get("completions/mean_length")
        s["trl_step_time"] = row.get("step_time")
    print(json.dumps({
        "side": "trl", "trl": trl.__version__, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "launch": T_LAUNCH, "imported": t_imported, "first_step_begin": marks.get("first_step_begin"),
        "end": t_end, "steps": steps,
    }))


if __name__ == "__main__":
    sys.exit(main())
