"""jaxrl vs. TRL's GRPOTrainer on the same tool-calling workload, in one invocation.

    bash scripts/setup_trl.sh                      # once: .venv-trl (TRL 1.16 + the CPU torch wheel)
    .venv/bin/python -m experiments.bench.vs_trl [--steps 10] [--prompts 1] [--generations 8]
        [--max-completion-length 128] [--max-tool-calls 4] [--max-prompt-tokens 512] [--lr 1e-6] [--async] [--stream]
        [--hidden 128] [--layers 4] [--intermediate 256] [--vocab 1000] [--repeats 1] [--jaxrl-only] [--tiny]

The workload, the same on both sides:

- the model: a tiny Qwen3 (`jaxrl.tiny`, 0.72M parameters) with a byte-level BPE of 1,000 tokens
  learned from general text and a Qwen2.5-style tool chat template (`experiments.bench.chat_tokenizer`:
  tokens per episode as a small general vocabulary has them, not as `jaxrl.tiny_tokenizer`'s corpus
  written around the games), PRIMED here in JAX by a supervised fine-tune on rendered binary-search
  demonstrations so that it calls the `guess(n)` tool, and saved as a Hugging Face directory both
  frameworks load (cached under runs/assets/vs_trl/; the priming takes ~10-35 min on 2 cores);
- the environment and reward: `experiments/bench/guess_env.py` (`GuessNumber`, TRL's
  `environment_factory` style: `reset(**row)`'s text appended to the row's user turn, a `guess`
  tool, a secret in 1..50), and `reward`, used unchanged by both, on the same dataset rows in TRL's
  format (a `prompt` of chat messages, a `seed`). An episode is ~300 prompt tokens, ~2.5 tool calls,
  ~60 model tokens and ~110 tokens in all, and most episodes end at the 128-token budget;
- per step `--prompts` tasks x `--generations` episodes at temperature 1, at most
  `--max-completion-length` completion tokens per episode (tool results included) and at most
  `--max-tool-calls` tool calls (TRL: `max_tool_calling_iterations`; jaxrl: `rollout.max_turns`
  = calls + 1, `rollout.max_total_tokens`), loss dapo, beta 0, the same constant learning rate,
  one optimizer step per batch, the same task rows (seeds); jaxrl with its defaults for everything
  else, as a user gets it: `rollout.max_prompt_tokens` sized from the environment's first prompt and
  `learner.prompt_widths` chosen from it (its padded batches run each step's prompts at the narrowest
  of a few widths, all compiled at the first step: startup and wall show what that costs; TRL pads to
  the batch's longest); `--max-prompt-tokens` / `--prompt-widths` set them instead;
- TRL runs as a subprocess in `.venv-trl` (`experiments/bench/vs_trl_trl_side.py`); jaxrl as
  `jaxrl train CONFIG` (the console script next to this interpreter), sync mode, and with
  `--async` once more in async mode (`rollout.mode: async`, `learner.loss.is_level: token`).
  They run one after the other, never together; `--repeats R` runs each R times, alternating, and
  reports each side's median run (with every run's s/step and the load average before it: other
  work on a shared machine slows both sides, TRL's torch threads far more than jaxrl).

Printed per side: median s/step over steps 3..N and per-phase medians (rollout = generate +
tools/environment, learn, weight sync), for jaxrl its engine's work a step (`engine`: ticks, device
calls, tokens, and the shares of its ticks and of the rollout spent in device calls), wall time
including start-up, time to the first step, jaxrl's XLA compiles after its first step (learner and
bridge; 0 expected), and the work per
episode (`WORK`: model turns, tool calls and errors, model-written and total completion tokens, the
share of episodes that ended at the token budget, prompt tokens) so a reader can see both sides did
the same work; the bench fails (exit 1, after printing) if either side makes ~0 tool calls, or if
turns, tool calls, model tokens or total tokens per episode differ from TRL's by more than 15%.
The last line is one JSON object; its `ratios` are jaxrl / TRL (lower is better for jaxrl):
`jaxrl_over_trl_step` and one per phase.

`--stream` runs jaxrl twice more with the bridge and the trainer pinned to one CPU each (the bridge
on the first of this process's CPUs, `bridge.cpus`; the trainer on the second, `taskset`): sync
mode, then stream mode (`rollout.mode: stream`, `in_flight_groups` = two steps' groups), and reports
`stream_over_sync_episodes_per_s` (same episodes per step, so the ratio of wall seconds per step)
with what bounds it: each phase alone (sync's rollout and learn), the learner's step while the
bridge generates (stream's learn), and the step that perfect overlap of the phases alone predicts,
max(rollout, learn), next to the one measured.

`--jaxrl-only` skips TRL (no .venv-trl needed); `--tiny` is a smoke size (a 2-layer model, 3
steps of 1 x 4 episodes, a short priming) for the test.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.bench.guess_env import INSTRUCTIONS

ROOT = Path(__file__).resolve().parents[2]
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
TRL_SIDE = ROOT / "experiments" / "bench" / "vs_trl_trl_side.py"
ASSETS = ROOT / "runs" / "assets" / "vs_trl"
ENV_CLASS = "experiments.bench.guess_env:GuessNumber"
REWARD_FN = "experiments.bench.guess_env:reward"
PHASES = ("rollout_s", "generate_s", "env_s", "learn_s", "sync_s")
ENGINE = ("busy_s", "device_s", "insert_s", "decode_calls", "shared_decode_calls", "insert_calls", "tokens")  # the JAX engine's work a step
PRIME_VERSION = "2"  # bump when the priming (demonstrations, recipe) changes: cached models are keyed by it
DEMO_COMPLETION_TOKENS = 192  # demonstrations are cut there: past the bench's episodes, which end at 128
MIN_TOOL_CALLS = 0.5  # per episode; below this a side hardly reaches the tool and the comparison is void
# The work per episode each side reports (means over all its episodes): model turns, tool calls, tool
# errors, tokens the model wrote, tokens of the completion in all (tool results included), the share of
# episodes that ended at the token budget, prompt tokens. The first four must agree within SAME_WORK.
WORK = ("turns", "tool_calls", "tool_errors", "model_tokens", "total_tokens", "capped", "prompt_tokens")
SAME_WORK = ("turns", "tool_calls", "model_tokens", "total_tokens")
SAME_WORK_TOLERANCE = 0.15


# -- the primed model ----------------------------------------------------------------------------


def _render_demo(tok, tools, secret: int, max_completion: int) -> tuple[list[int], list[int]]:
    """A binary-search episode rendered by the chat template: (ids, loss mask on the model's turns), cut
    `max_completion` tokens after the prompt (no episode of the bench goes further).

    Segments are encoded one by one, as rollouts produce them: the prompt up to the generation prompt,
    each assistant turn through its end-of-turn token (trained), the tool results and the next
    generation prompt (not trained).
    """
    from experiments.bench.guess_env import INSTRUCTIONS, binary_search, reset_text

    conv = [{"role": "user", "content": INSTRUCTIONS + reset_text()}]
    for n, answer in binary_search(secret):
        conv.append({"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": "guess", "arguments": {"n": n}}}]})
        conv.append({"role": "tool", "name": "guess", "content": answer})
    conv.append({"role": "assistant", "content": f"The number is {secret}."})
    text = tok.apply_chat_template(conv, tools=tools, tokenize=False)
    head, eos = "<|im_start|>assistant\n", tok.eos_token
    ids: list[int] = []
    mask: list[int] = []
    at = 0
    prompt_len = None
    while (start := text.find(head, at)) >= 0:
        start += len(head)
        end = text.index(eos, start) + len(eos)
        for piece, trained in ((text[at:start], 0), (text[start:end], 1)):
            piece_ids = tok.encode(piece, add_special_tokens=False)
            ids += piece_ids
            mask += [trained] * len(piece_ids)
            prompt_len = len(ids) if prompt_len is None else prompt_len
        at = end
    return ids[:prompt_len + max_completion], mask[:prompt_len + max_completion]


def prime_model(out_dir: Path, *, hidden: int, layers: int, intermediate: int, vocab: int, steps: int,
                lr: float = 3e-3, seed: int = 0) -> dict:
    """Builds the tiny model and fine-tunes it on the demonstrations (JAX); saves an HF directory."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from transformers.utils import get_json_schema

    from experiments.bench.chat_tokenizer import build_tokenizer
    from experiments.bench.guess_env import HIGH, LOW, GuessNumber
    from jaxrl.models import load_pretrained, save_pretrained
    from jaxrl.tiny import build_tiny_model

    t0 = time.perf_counter()
    tok = build_tokenizer(vocab_size=vocab)
    # A directory of its own: two benches priming at once must not write into each other's.
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", suffix=".tmp", dir=out_dir.parent))
    build_tiny_model(tmp, "qwen3", seed=seed, tokenizer=tok, hidden_size=hidden, num_layers=layers,
                     intermediate_size=intermediate)
    # Both sides render the tool's schema as transformers' get_json_schema writes it.
    demos = [_render_demo(tok, [get_json_schema(GuessNumber().guess)], s, DEMO_COMPLETION_TOKENS) for s in range(LOW, HIGH + 1)]
    width = max(len(ids) for ids, _ in demos)
    ids_np = np.full((len(demos), width), tok.pad_token_id, np.int32)
    attn_np = np.zeros((len(demos), width), np.int32)
    loss_np = np.zeros((len(demos), width), np.float32)
    for i, (ids, mask) in enumerate(demos):
        ids_np[i, :len(ids)], attn_np[i, :len(ids)], loss_np[i, :len(ids)] = ids, 1, mask

    model = load_pretrained(tmp)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(steps // 10, 1), steps, lr * 0.1)
    tx = optax.adamw(schedule, weight_decay=0.0)
    opt_state = tx.init(params)
    from jaxrl.models import positions_from_mask

    def loss_fn(p, ids, attn, weights):
        m = nnx.merge(graphdef, p, rest)
        logits, _ = m(ids[:, :-1], positions_from_mask(attn[:, :-1]), attn[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        target = ids[:, 1:]
        nll = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
        w = weights[:, 1:]
        acc = (jnp.argmax(logits, -1) == target).astype(jnp.float32)
        return (nll * w).sum() / w.sum(), (acc * w).sum() / w.sum()

    @jax.jit
    def train_step(p, o, ids, attn, weights):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, ids, attn, weights)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss, acc

    batch = (jnp.asarray(ids_np), jnp.asarray(attn_np), jnp.asarray(loss_np))
    for _ in range(steps):
        params, opt_state, loss, acc = train_step(params, opt_state, *batch)
    nnx.update(model, params)
    save_pretrained(model, tmp)
    info = {"prime_steps": steps, "prime_loss": round(float(loss), 4),
            "prime_token_accuracy": round(float(acc), 4), "demonstrations": len(demos),
            "params": int(sum(x.size for x in jax.tree.leaves(params))), "prime_s": round(time.perf_counter() - t0, 1)}
    (tmp / "primed.json").write_text(json.dumps(info) + "\n")
    # The model appears whole or not at all (`primed_model` takes a directory with primed.json).
    if not (out_dir / "primed.json").is_file():
        shutil.rmtree(out_dir, ignore_errors=True)  # a crashed run's leftovers
        try:
            tmp.rename(out_dir)
            return info
        except OSError:  # another bench renamed its own first: keep that one
            pass
    shutil.rmtree(tmp)
    return json.loads((out_dir / "primed.json").read_text())


def primed_model(args) -> tuple[Path, dict]:
    """The primed model directory for these sizes, built once (keyed by sizes and the code it came from)."""
    from experiments.bench.chat_tokenizer import corpus_key

    sizes = dict(hidden=args.hidden, layers=args.layers, intermediate=args.intermediate, vocab=args.vocab,
                 steps=args.prime_steps)
    code = hashlib.sha256((ROOT / "experiments/bench/guess_env.py").read_bytes()
                          + PRIME_VERSION.encode()).hexdigest()[:10]
    name = "-".join(f"{k}{v}" for k, v in sizes.items()) + f"-{code}-{corpus_key()}"
    out = ASSETS / name
    if (out / "primed.json").is_file():
        return out, json.loads((out / "primed.json").read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"vs_trl: priming the tiny model ({name})", file=sys.stderr, flush=True)
    return out, prime_model(out, **sizes)


# -- the two sides -------------------------------------------------------------------------------


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _run(cmd: list[str], log_path: Path, timeout: float) -> tuple[float, str]:
    """Runs `cmd` in the repository root, stdout+stderr to `log_path`; (launch time, last stdout line)."""
    launch = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=_child_env(), stdout=subprocess.PIPE, stderr=log, text=True,
                              timeout=timeout)
        log.write(proc.stdout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-25:])
        raise SystemExit(f"vs_trl: {Path(cmd[0]).name} {' '.join(cmd[1:3])} failed (exit {proc.returncode}); "
                         f"log {log_path}:\n{tail}")
    return launch, lines[-1]


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(vals), 4) if vals else None


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.fmean(vals), 3) if vals else None


def summarize(rows: list[dict], launch: float, first_step_begin: float, end: float, skip: int) -> dict:
    """Medians over the steps after the first `skip` (warm-up), start-up and wall, work per episode."""
    timed = rows[skip:] or rows
    out = {"steps": len(rows), "steps_timed": len(timed), "s_per_step": _median(timed, "step_s")}
    out.update({p: _median(timed, p) for p in PHASES})
    # Per step, then the median (medians of parts do not add up). Negative in async mode, where the rollout
    # of the next step overlaps the update.
    for r in timed:
        r["other_s"] = r["step_s"] - sum(r[p] or 0.0 for p in ("rollout_s", "learn_s", "sync_s"))
    out["other_s"] = _median(timed, "other_s")
    gaps = [b["time"] - a["time"] for a, b in zip(rows[skip - 1:] if skip else rows, rows[skip:] if skip else rows[1:])]
    out["wall_per_step_s"] = round(statistics.median(gaps), 4) if gaps else None
    out["startup_s"] = round(first_step_begin - launch, 2)
    out["wall_s"] = round(end - launch, 2)
    out["first_step_s"] = round(rows[0]["step_s"], 3)
    out["per_episode"] = {k: _mean(rows, k) for k in WORK}
    out["reward_mean"] = _mean(rows, "reward_mean")
    return out


def run_trl(args, model_dir: Path, tasks: Path, tmp: Path) -> dict:
    cmd = [str(TRL_PYTHON), str(TRL_SIDE), "--model", str(model_dir), "--tasks", str(tasks),
           "--out", str(tmp / "trl_out"), "--steps", str(args.steps), "--prompts", str(args.prompts),
           "--generations", str(args.generations), "--max-completion-length", str(args.max_completion_length),
           "--max-tool-calls", str(args.max_tool_calls), "--lr", str(args.lr), "--seed", str(args.seed)]
    launch, last = _run(cmd, tmp / "trl.log", args.timeout)
    res = json.loads(last)
    out = summarize(res["steps"], launch, res["first_step_begin"], res["end"], args.skip)
    # Cross-checks against TRL's own logged metrics: its `step_time` (training_step only: without the optimizer
    # step) and `tools/call_frequency` should match our step_s and tool calls per episode.
    timed = res["steps"][args.skip:] or res["steps"]
    out["trl_own"] = {"step_time": _median(timed, "trl_step_time"),
                      "tools_call_frequency": _mean(res["steps"], "trl_tools_call_frequency"),
                      "completions_mean_length": _mean(res["steps"], "trl_completions_mean_length")}
    out.update(framework=f"trl {res['trl']} (torch {res['torch']}, {res['threads']} threads)", log=str(tmp / "trl.log"))
    return out


def jaxrl_config(args, model_dir: Path, tasks: Path, run_dir: Path, mode: str, bridge_cpus: list[int]) -> dict:
    loss = {"loss_type": "dapo", "beta": 0.0}
    if mode != "sync":
        loss["is_level"] = "token"
    return {
        "bridge": {"cpus": bridge_cpus},
        "run_dir": str(run_dir),
        "model": {"dir": str(model_dir)},
        "envs": [{"name": "guess", "env_class": ENV_CLASS}],
        "rewards": [{"fn": REWARD_FN}],
        "steps": args.steps,
        "seed": args.seed,
        "data": {"train_file": str(tasks), "seed": args.seed},
        "rollout": {"mode": mode, "groups_per_step": args.prompts, "temperature": 1.0, "top_p": 1.0,
                    "max_tokens": args.max_completion_length, "max_turns": args.max_tool_calls + 1,
                    "max_total_tokens": args.max_completion_length,
                    **({} if args.max_prompt_tokens is None else {"max_prompt_tokens": args.max_prompt_tokens})},
        "learner": {"group_size": args.generations, "grad_accum": 1, "num_iterations": 1, "loss": loss,
                    **({} if args.prompt_widths is None else {"prompt_widths": args.prompt_widths}),
                    "optimizer": {"learning_rate": args.lr, "schedule": "constant", "warmup_steps": 0,
                                  "weight_decay": 0.0, "max_grad_norm": 1.0}},
        "eval": {"episodes": 0, "before": False},
        "log": {"tensorboard": False, "progress": False, "samples_per_step": 1},
        "sync_every": 1,
        "checkpoint_every": 10**9,  # only the final checkpoint (after the last step), as TRL saves none
    }


def run_jaxrl(args, model_dir: Path, tasks: Path, tmp: Path, mode: str, pinned: bool = False) -> dict:
    """`jaxrl train` in `mode`; `pinned`: the bridge on this process's first CPU, the trainer on its second."""
    import yaml

    name = f"jaxrl_{mode}" + "_pinned" * pinned
    run_dir = tmp / name
    cfg_path = tmp / f"{name}.yaml"
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if pinned and len(cpus) < 2:
        raise SystemExit("vs_trl: --stream pins the bridge and the trainer to a CPU each; run it on 2 CPUs or more")
    cfg_path.write_text(yaml.safe_dump(jaxrl_config(args, model_dir, tasks, run_dir, mode, cpus[:1] if pinned else []),
                                       sort_keys=False))
    jaxrl = Path(sys.executable).parent / "jaxrl"
    if not jaxrl.is_file():
        raise SystemExit(f"vs_trl: no `jaxrl` console script next to {sys.executable}: run the bench with the "
                         "python of the venv jaxrl is installed in")
    cmd = (["taskset", "-c", str(cpus[1])] if pinned else []) + [str(jaxrl), "train", str(cfg_path)]
    launch, last = _run(cmd, tmp / f"{name}.log", args.timeout)
    end = time.time()
    summary = json.loads(last)
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "time/step_s" not in m:
            continue
        rows.append({"step": m["step"], "time": m["time"], **{p: m.get(f"time/{p}") for p in ("step_s", *PHASES)},
                     "tool_calls": m.get("env/guess/tool_calls", 0.0),
                     "tool_errors": m.get("env/guess/tool_errors", 0.0), "model_tokens": m.get("completion/model_tokens"),
                     "total_tokens": m.get("completion/total_tokens"), "turns": m.get("completion/turns"),
                     "capped": m.get("completion/truncated"), "reward_mean": m.get("reward/mean"),
                     "prompt_tokens": m.get("prompt/tokens"),
                     **{k: m.get(f"engine/{k}") for k in ENGINE}})
    if not rows:
        raise SystemExit(f"vs_trl: jaxrl wrote no step metrics to {run_dir / 'metrics.jsonl'}")
    # The first step began step_s before its row was logged.
    first_begin = rows[0]["time"] - rows[0]["step_s"]
    out = summarize(rows, launch, first_begin, end, args.skip)
    out["engine"] = engine_figures(rows[args.skip:] or rows)
    out.update(framework=f"jaxrl ({mode}{', pinned' * pinned})", run_wall_s=summary.get("wall_s"),
               startup_phases=summary.get("startup"), programs_after_first_step=summary.get("programs_after_first_step"),
               log=str(tmp / f"{name}.log"))
    return out


def engine_figures(timed: list[dict]) -> dict:
    """Medians of the bridge's engine work per step (`engine/*` metrics), the shares in device calls
    of the engine's ticks and of the step's rollout (what is left is the host's), and the inserts'
    share of the device calls (the rest is decoding)."""
    out = {k: _median(timed, k) for k in ENGINE if all(r.get(k) is not None for r in timed)}
    if "device_s" in out:
        for r in timed:
            r["of_ticks"] = r["device_s"] / r["busy_s"] if r["busy_s"] else None
            r["of_rollout"] = r["device_s"] / r["rollout_s"] if r.get("rollout_s") else None
        out["device_share_of_ticks"] = _median(timed, "of_ticks")
        out["device_share_of_rollout"] = _median(timed, "of_rollout")
    if "insert_s" in out:
        for r in timed:
            r["inserts_of_device"] = r["insert_s"] / r["device_s"] if r["device_s"] else None
        out["insert_share_of_device"] = _median(timed, "inserts_of_device")
    return out


# -- the report ----------------------------------------------------------------------------------


def ratios(jaxrl: dict, trl: dict) -> dict:
    out = {}
    for key, name in (("s_per_step", "step"), ("rollout_s", "rollout"), ("generate_s", "generate"),
                      ("env_s", "tools"), ("learn_s", "learn"), ("wall_s", "wall"), ("startup_s", "startup")):
        a, b = jaxrl.get(key), trl.get(key)
        out[f"jaxrl_over_trl_{name}"] = round(a / b, 3) if a is not None and b else None
    return out


def different_work(sides: dict[str, dict]) -> list[str]:
    """Each jaxrl side's work per episode (SAME_WORK) that differs from TRL's by more than SAME_WORK_TOLERANCE."""
    trl = sides["trl"]["per_episode"]
    out = []
    for name, side in sides.items():
        for key in SAME_WORK if name != "trl" else ():
            a, b = side["per_episode"].get(key), trl.get(key)
            if a is None or b is None or abs(a - b) > SAME_WORK_TOLERANCE * max(abs(b), 1e-9):
                out.append(f"{name} {key} per episode {a} against TRL's {b}: more than "
                           f"{SAME_WORK_TOLERANCE:.0%} apart, so the sides did not do the same work")
    return out


def stream_figures(sync: dict, stream: dict) -> dict:
    """Streaming over sync, both pinned, and what bounds it: the phases alone and overlapped."""
    rollout, learn = sync["rollout_s"], sync["learn_s"]
    return {"stream_over_sync_episodes_per_s": round(sync["wall_per_step_s"] / stream["wall_per_step_s"], 3),
            "alone": {"rollout_s": rollout, "learn_s": learn, "step_s": sync["wall_per_step_s"]},
            "overlapped": {"learn_s": stream["learn_s"], "waiting_for_groups_s": stream["rollout_s"],
                           "step_s": stream["wall_per_step_s"]},
            "predicted_step_s": round(max(rollout, learn), 4),
            "predicted_over_sync": round(sync["wall_per_step_s"] / max(rollout, learn), 3)}


def _print_table(sides: dict[str, dict]) -> None:
    keys = ("s_per_step", "rollout_s", "generate_s", "env_s", "learn_s", "sync_s", "other_s", "wall_per_step_s",
            "first_step_s", "startup_s", "wall_s", "programs_after_first_step")
    names = list(sides)
    print(f"{'':>22}" + "".join(f"{n:>14}" for n in names))
    for k in keys:
        print(f"{k:>22}" + "".join(f"{_fmt(sides[n].get(k)):>14}" for n in names))
    for k in WORK:
        print(f"{'episode ' + k:>22}" + "".join(f"{_fmt(sides[n]['per_episode'].get(k)):>14}" for n in names))
    print(f"{'reward_mean':>22}" + "".join(f"{_fmt(sides[n].get('reward_mean')):>14}" for n in names))


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="training steps per side (medians over steps 3..N)")
    p.add_argument("--prompts", type=int, default=1, help="prompts (groups) per step")
    p.add_argument("--generations", type=int, default=8, help="episodes per prompt")
    p.add_argument("--max-completion-length", type=int, default=128, help="completion tokens per episode, "
                   "tool results included")
    p.add_argument("--max-tool-calls", type=int, default=4)
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="jaxrl's rollout.max_prompt_tokens (the "
                   "prompt takes ~300 tokens); default: jaxrl's, sized from the first prompt")
    p.add_argument("--prompt-widths", type=int, default=None, help="jaxrl's learner.prompt_widths (prompt widths "
                   "its padded batches take, all compiled at the first step); default: jaxrl's")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--prime-steps", type=int, default=300, help="supervised priming steps")
    p.add_argument("--async", dest="run_async", action="store_true", help="also run jaxrl in async mode")
    p.add_argument("--stream", action="store_true", help="also run jaxrl pinned (bridge and trainer on one CPU each) "
                   "in sync and in stream mode")
    p.add_argument("--jaxrl-only", action="store_true", help="skip TRL (no .venv-trl needed)")
    p.add_argument("--tiny", action="store_true", help="smoke size: hidden 64, 2 layers, 3 steps of 1 x 4, short priming")
    p.add_argument("--keep", metavar="DIR", help="keep the run directories and logs here")
    p.add_argument("--repeats", type=int, default=1, help="runs per side, alternating; the median run is reported")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per side")
    args = p.parse_args(argv)
    if args.tiny:
        args.steps, args.prompts, args.generations = min(args.steps, 3), 1, 4
        args.hidden, args.layers, args.intermediate, args.prime_steps = 64, 2, 128, 100
    args.skip = 2 if args.steps >= 4 else 1  # steps 1-2 compile / warm up
    if args.stream and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("vs_trl: --stream pins the bridge and the trainer to a CPU each: it needs two CPUs")
    if not args.jaxrl_only and not TRL_PYTHON.is_file():
        print(f"vs_trl: {TRL_PYTHON.parent.parent.relative_to(ROOT)} is missing: create it with "
              f"`bash scripts/setup_trl.sh` (~1-2 min), or pass --jaxrl-only")
        raise SystemExit(2)

    model_dir, primed = primed_model(args)
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="vs_trl-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        tasks = tmp / "tasks.jsonl"
        n_rows = args.steps * args.prompts
        rows = [{"prompt": [{"role": "user", "content": INSTRUCTIONS}], "seed": args.seed * 100_003 + i}
                for i in range(n_rows)]  # TRL's dataset format: reset()'s text is appended to the user turn
        tasks.write_text("".join(json.dumps({"env": "guess", **row}) + "\n" for row in rows))
        trl_tasks = tmp / "trl_tasks.jsonl"  # the same rows without jaxrl's `env` routing field
        trl_tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
        runs: dict[str, list[dict]] = {}
        for _ in range(args.repeats):  # alternating, so that a change in the machine's load hits both sides
            for name, fn in (("trl", lambda: run_trl(args, model_dir, trl_tasks, tmp)),
                             ("jaxrl", lambda: run_jaxrl(args, model_dir, tasks, tmp, "sync")),
                             ("jaxrl_async", lambda: run_jaxrl(args, model_dir, tasks, tmp, "async")),
                             ("jaxrl_sync_pinned", lambda: run_jaxrl(args, model_dir, tasks, tmp, "sync", True)),
                             ("jaxrl_stream_pinned", lambda: run_jaxrl(args, model_dir, tasks, tmp, "stream", True))):
                if ((name == "trl" and args.jaxrl_only) or (name == "jaxrl_async" and not args.run_async)
                        or (name.endswith("_pinned") and not args.stream)):
                    continue
                load = os.getloadavg()[0]  # other work on the machine skews both sides, torch's threads most
                for stale in ("jaxrl_sync", "jaxrl_async", "jaxrl_sync_pinned", "jaxrl_stream_pinned", "trl_out"):
                    shutil.rmtree(tmp / stale, ignore_errors=True)
                runs.setdefault(name, []).append({**fn(), "loadavg_1m_before": round(load, 2)})
        sides = {}
        for name, rs in runs.items():  # the run with the median s/step, and every run's s/step
            pick = sorted(rs, key=lambda r: r["s_per_step"])[(len(rs) - 1) // 2]
            sides[name] = {**pick, "s_per_step_runs": [r["s_per_step"] for r in rs],
                           "loadavg_1m_runs": [r["loadavg_1m_before"] for r in rs]}
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    _print_table(sides)
    result = {
        "workload": {"prompts": args.prompts, "generations": args.generations, "steps": args.steps,
                     "timed_steps": f"{args.skip + 1}..{args.steps}", "max_completion_length": args.max_completion_length,
                     "max_tool_calls": args.max_tool_calls, "lr": args.lr, "loss": "dapo", "beta": 0.0,
                     "temperature": 1.0, "model": {"hidden": args.hidden, "layers": args.layers,
                                                   "intermediate": args.intermediate, "vocab": args.vocab, **primed}},
        **{name: {k: v for k, v in s.items() if k != "log"} for name, s in sides.items()},
    }
    idle = {name: s["per_episode"]["tool_calls"] for name, s in sides.items()
            if (s["per_episode"]["tool_calls"] or 0.0) < MIN_TOOL_CALLS}
    errors = []
    if idle:
        errors.append(f"tool calls per episode below {MIN_TOOL_CALLS} on {', '.join(idle)} ({idle}): that side "
                      "hardly reaches the tool, so the sides did not do the same work")
    if "trl" in sides:
        errors += different_work(sides)
    if errors:
        result["error"] = "; ".join(errors)
    if args.stream:
        result["stream"] = stream_figures(sides["jaxrl_sync_pinned"], sides["jaxrl_stream_pinned"])
    if "trl" in sides:  # last, as promised
        result["ratios"] = ratios(sides["jaxrl"], sides["trl"])
        if "jaxrl_async" in sides:
            result["ratios"]["jaxrl_async_over_trl_step"] = ratios(sides["jaxrl_async"], sides["trl"])[
                "jaxrl_over_trl_step"]
    print(json.dumps(result))
    if errors and not args.tiny:  # the smoke size's briefly primed model may not reach the tool: reported only
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
