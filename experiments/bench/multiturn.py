"""Generation on the multi-turn rollout path: episodes arriving one by one, 2-4 turns each; the JAX
engine's continuous batching vs. the same engine run batch-synchronously, vs. one full batch of the
same tokens (the ceiling), and vs. transformers' `generate` serving the same episodes.

    python -m experiments.bench.multiturn [--episodes 64] [--model-dir DIR | --hidden 128 --layers 4 ...]
        [--prompt-tokens 350] [--turns 2 4] [--turn-tokens 16 48] [--mix uniform|long-tail]
        [--tool-tokens 10 20] [--max-delay-ms 50] [--group-size 1] [--decode-steps 16] [--repeats 3]
        [--hf-batching round|grouped] [--skip-hf] [--skip-sequential] [--tiny]

The script (seeded, the same for every side): episode i arrives after a delay drawn in
[0, --max-delay-ms], has a prompt of --prompt-tokens +- 10% random ids, a number of turns drawn in
--turns, per turn a number of tokens to generate (temperature 1, no stop tokens: every turn
produces exactly that many) and after every turn but the last a "tool result" of ids drawn in
--tool-tokens, appended before the next turn; with --group-size G, each G consecutive episodes share
their prompt and arrival time (a GRPO group). Turn lengths: `--mix uniform` draws them in
--turn-tokens; `--mix long-tail` draws 90% of turns in 8-32 tokens and 10% in 256-512 (`--tiny`:
2-4 and 16-32). Each turn re-sends the whole sequence so far (prompt, completions, tool results) as a
new prompt, as the bridge does.

- `jax`: `JaxEngine` (`--max-batch` slots advanced `--decode-steps` tokens per device call) in this
  process; each episode an asyncio task that sleeps its delay and then calls
  `engine.generate([ids], SamplingParams(n=1, max_tokens=turn tokens))` once per turn, as
  `bridge.rollout.run_episode` does. A turn that arrives while others decode joins them at the next
  device call. Not behind a bridge process: the bridge's contract runs whole episodes against
  environments, and `engines` measures what the bridge adds to one batch.
- `jax_batch_sync`: the same, on an engine whose device call runs until every row in it ended
  (`decode_steps` = max_seq_len) and takes new rows only between calls: the engine's behaviour
  before continuous batching (a turn that arrives during a call waits for the call's slowest row).
  One difference, in its favour: between two busy calls it starts at once with the rows that
  arrived, where the old engine waited its batch window for more.
- `ceiling`: the continuous engine given the same number of generated tokens as one full batch:
  `--max-batch` rows arriving together, prompts of the script's mean prompt length (with --group-size G,
  each G rows the same prompt), the tokens split evenly. `jax_over_ceiling` is the share of that
  throughput the multi-turn path keeps.
- `hf_turn_sync`: the same model in transformers (torch, CPU) served the way TRL's
  `environment_factory` loop serves it: turn-synchronous rounds. Every episode is there at the start
  (no arrival delays: its best case); round r generates turn r of every episode that has one in one
  left-padded `generate` call (`use_cache=True`, sampling at temperature 1, top-k off) of the round's
  longest turn (`min_new_tokens` = `max_new_tokens`), keeps each episode's scripted number of tokens,
  and appends the tool results. The steps a shorter turn idles through are what TRL's single
  `generate` per round spends on an episode that stopped early; they are reported
  (`token_steps`) but not counted as generated tokens. `--hf-batching grouped` instead runs one
  call per distinct turn length in a round (no idle steps, more and smaller calls).
- `hf_sequential`: one episode after another, one `generate` of exactly the turn's tokens per turn
  (batch 1; a single-stream server). `--skip-sequential` leaves it out.

The JAX engines compile every batch size before their timed runs (`warm_up`) and keep recent
sequences' keys and values (an episode's next turn prefills only its new tokens:
`prompt_tokens_from_prefix_cache` is the share of prompt tokens it did not prefill; the cache is
emptied before each run). The three JAX sides run `--repeats` times, alternated: each side reports
its median run, each ratio is the median of the runs' ratios. Transformers runs the script once
untimed (torch allocates), then once timed.
Generated tokens are asserted equal on every side (the script's total). Reported per side: wall
seconds for all episodes, generated tokens/s, the median per-turn latency (JAX: the `generate` call
of that turn, batching wait included; turn-synchronous: from the round's start to the end of the
call that produced the turn; sequential: the call), and for JAX the engine's device calls (`decode_calls`,
`rows`, `shared_decode_calls`: the calls that read each group's prompt once) and the XLA compiles during the
timed run (0 when the warm-up covered every shape).
Threads: XLA's CPU client uses one intra-op thread per core it may use; torch gets as many
(`torch.set_num_threads`, or `--torch-threads`). The sides run one after the other, never together.
On a machine shared with other work, torch's threads suffer far more than XLA's when a core is
taken (the `--tiny` turn-synchronous run at load 3.6 on 2 cores: 0.24 s with 2 torch threads, 0.02 s
with 1): read `load_before` (1-minute load average) next to each figure.
The machine's floor (`experiments.bench.roofline`, measured in the same run: memory bandwidth before
and after the JAX sides, the best of the two, and XLA's matmul rate at the model's shapes) of one
decode step of --max-batch rows at the ceiling run's mean context (a group's prompt read once for the
group): `ceiling_over_floor` and
`jax_over_floor` are each side's tokens/s over the floor's (1 would be the machine's limit).
The last line is one JSON object; `ratios`: `jax_over_ceiling` (multi-turn tokens/s over one full
batch's), `continuous_over_batch_sync`, the two over the floor, and JAX tokens/s over transformers
tokens/s (>1: JAX faster).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from bridge.engines.base import SamplingParams
from bridge.engines.jax_engine import JaxEngine
from experiments.bench.roofline import decode_floor, memory_bandwidth
from jaxrl.compilation import compiles
from jaxrl.host_memory import restart_tuned


@dataclasses.dataclass(frozen=True)
class Episode:
    index: int
    delay_s: float
    prompt: list[int]
    turns: list[int]  # tokens to generate per turn
    tools: list[list[int]]  # the tool result appended after each turn but the last

    @property
    def tokens(self) -> int:
        return sum(self.turns)


def make_script(episodes: int, vocab: int, prompt_tokens: int, turns: tuple[int, int],
                turn_tokens: tuple[int, int], tool_tokens: tuple[int, int], max_delay_ms: float,
                seed: int = 0, tail: tuple[float, int, int] | None = None, group: int = 1) -> list[Episode]:
    """The episodes every side serves; ids in [10, vocab) (clear of the usual special ids). `tail`:
    (share, low, high): that share of turns draws its length in [low, high] instead. `group`: episodes
    i and j share their prompt (and arrival) when i // group == j // group, as a GRPO group's do."""
    rng = np.random.default_rng(seed)
    script = []
    for i in range(episodes):
        n_turns = int(rng.integers(turns[0], turns[1] + 1))
        length = max(1, int(rng.integers(round(0.9 * prompt_tokens), round(1.1 * prompt_tokens) + 1)))
        episode = Episode(
            index=i,
            delay_s=float(rng.uniform(0, max_delay_ms / 1000)),
            prompt=rng.integers(10, vocab, length).tolist(),
            turns=rng.integers(turn_tokens[0], turn_tokens[1] + 1, n_turns).tolist(),
            tools=[rng.integers(10, vocab, rng.integers(tool_tokens[0], tool_tokens[1] + 1)).tolist()
                   for _ in range(n_turns - 1)],
        )
        if tail is not None:
            share, low, high = tail
            long = rng.random(n_turns) < share
            episode.turns[:] = np.where(long, rng.integers(low, high + 1, n_turns), episode.turns).tolist()
        if i % group:
            leader = script[i - i % group]
            episode = dataclasses.replace(episode, delay_s=leader.delay_s, prompt=leader.prompt)
        script.append(episode)
    return script


def _figures(wall_s: float, tokens: int, latencies: list[float]) -> dict:
    return {"wall_s": wall_s, "tok_s": tokens / wall_s, "tokens": tokens,
            "turn_latency_median_ms": 1000 * statistics.median(latencies), "turns": len(latencies)}


# -- JAX engine ----------------------------------------------------------------------------------


async def _jax_episode(engine: JaxEngine, ep: Episode, latencies: list[float]) -> int:
    await asyncio.sleep(ep.delay_s)
    ids, produced = list(ep.prompt), 0
    for t, n_new in enumerate(ep.turns):
        params = SamplingParams(n=1, temperature=1.0, max_tokens=n_new, seed=ep.index * 16 + t)
        start = time.perf_counter()
        [[completion]] = await engine.generate([ids], params)
        latencies.append(time.perf_counter() - start)
        assert len(completion.token_ids) == n_new, (ep.index, t, len(completion.token_ids), n_new)
        ids += completion.token_ids
        produced += len(completion.token_ids)
        if t < len(ep.tools):
            ids += ep.tools[t]
    return produced


def run_jax(engine: JaxEngine, script: list[Episode]) -> dict:
    latencies: list[float] = []

    async def episodes():
        return await asyncio.gather(*(_jax_episode(engine, ep, latencies) for ep in script))

    before, compiled = dict(engine.stats), compiles()
    start = time.perf_counter()
    produced = sum(asyncio.run(episodes()))
    wall = time.perf_counter() - start
    out = _figures(wall, produced, latencies)
    delta = {k: engine.stats[k] - before.get(k, 0) for k in ("decode_calls", "shared_decode_calls", "rows", "busy_s",
                                                             "device_s", "insert_s", "prefix_prompt_tokens",
                                                             "prefix_cached_tokens")}
    out.update(decode_calls=delta["decode_calls"], shared_decode_calls=delta["shared_decode_calls"], rows=delta["rows"],
               rows_per_decode_call=delta["rows"] / delta["decode_calls"],
               busy_s=delta["busy_s"], device_s=delta["device_s"], insert_s=delta["insert_s"],
               compiles=compiles() - compiled,
               prompt_tokens_from_prefix_cache=delta["prefix_cached_tokens"] / delta["prefix_prompt_tokens"])
    return out


def run_ceiling(engine: JaxEngine, rows: int, prompt_tokens: int, tokens: int, vocab: int, group: int) -> dict:
    """`tokens` generated as one full batch: `rows` prompts arriving together (each `group` of them the
    same), the tokens split evenly."""
    rng = np.random.default_rng(1)
    prompts = [p for p in (rng.integers(10, vocab, prompt_tokens).tolist() for _ in range(-(-rows // group)))
               for _ in range(group)][:rows]
    budgets = [tokens // rows + (r < tokens % rows) for r in range(rows)]

    async def batch():
        return await asyncio.gather(*(engine.generate([p], SamplingParams(n=1, temperature=1.0, max_tokens=m, seed=r))
                                      for r, (p, m) in enumerate(zip(prompts, budgets))))

    before, compiled = engine.stats["decode_calls"], compiles()
    start = time.perf_counter()
    produced = sum(len(c.token_ids) for [[c]] in asyncio.run(batch()))
    wall = time.perf_counter() - start
    assert produced == tokens, (produced, tokens)
    return {"wall_s": wall, "tok_s": tokens / wall, "tokens": tokens, "rows": rows, "prompt_tokens": prompt_tokens,
            "decode_calls": engine.stats["decode_calls"] - before, "compiles": compiles() - compiled}


# -- transformers --------------------------------------------------------------------------------


class HF:
    """The model in transformers (torch, CPU, float32), sampling as the JAX side does."""

    def __init__(self, model_dir: Path, threads: int):
        import torch
        import transformers

        torch.set_num_threads(threads)
        transformers.utils.logging.disable_progress_bar()
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, local_files_only=True).eval()
        self.pad_id = self.model.config.pad_token_id or 0
        self.calls = 0
        self.token_steps = 0

    def generate(self, seqs: list[list[int]], n_new: int) -> list[list[int]]:
        """Exactly `n_new` sampled tokens per sequence: one left-padded `generate` call."""
        torch = self.torch
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = torch.tensor(s)
            mask[i, width - len(s):] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, use_cache=True, do_sample=True, temperature=1.0,
                top_k=0, top_p=1.0, max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=self.pad_id,
            )
        new = out[:, width:]
        assert new.shape[1] == n_new, (new.shape, n_new)
        self.calls += 1
        self.token_steps += new.numel()
        return new.tolist()


def run_hf_turn_sync(hf: HF, script: list[Episode], grouped: bool) -> dict:
    """TRL's loop: all live episodes' current turn per round; one call per round (or per turn length)."""
    hf.torch.manual_seed(0)
    hf.calls = hf.token_steps = 0
    live = [(ep, list(ep.prompt)) for ep in script]
    latencies: list[float] = []
    produced = 0
    start = time.perf_counter()
    r = 0
    while live:
        round_start = time.perf_counter()
        if grouped:
            calls = [(n, [(ep, ids) for ep, ids in live if ep.turns[r] == n])
                     for n in sorted({ep.turns[r] for ep, _ in live})]
        else:
            calls = [(max(ep.turns[r] for ep, _ in live), live)]
        for n_new, members in calls:
            outs = hf.generate([ids for _, ids in members], n_new)
            done = time.perf_counter()
            for (ep, ids), toks in zip(members, outs):
                kept = toks[:ep.turns[r]]  # a shorter turn would have stopped here
                ids += kept
                produced += len(kept)
                latencies.append(done - round_start)
        for ep, ids in live:
            if r < len(ep.tools):
                ids += ep.tools[r]
        r += 1
        live = [(ep, ids) for ep, ids in live if r < len(ep.turns)]
    wall = time.perf_counter() - start
    out = _figures(wall, produced, latencies)
    out.update(generate_calls=hf.calls, token_steps=hf.token_steps)
    return out


def run_hf_sequential(hf: HF, script: list[Episode]) -> dict:
    hf.torch.manual_seed(0)
    hf.calls = hf.token_steps = 0
    latencies: list[float] = []
    produced = 0
    start = time.perf_counter()
    for ep in script:
        ids = list(ep.prompt)
        for t, n_new in enumerate(ep.turns):
            t0 = time.perf_counter()
            [toks] = hf.generate([ids], n_new)
            latencies.append(time.perf_counter() - t0)
            ids += toks
            produced += len(toks)
            if t < len(ep.tools):
                ids += ep.tools[t]
    wall = time.perf_counter() - start
    out = _figures(wall, produced, latencies)
    out.update(generate_calls=hf.calls)
    return out


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=350, help="mean prompt length (+- 10%%)")
    p.add_argument("--turns", type=int, nargs=2, default=(2, 4), metavar=("MIN", "MAX"))
    p.add_argument("--turn-tokens", type=int, nargs=2, default=(16, 48), metavar=("MIN", "MAX"),
                   help="tokens generated per turn")
    p.add_argument("--mix", choices=("uniform", "long-tail"), default="uniform",
                   help="turn lengths: uniform in --turn-tokens, or 90%% in 8-32 and 10%% in 256-512 tokens")
    p.add_argument("--tool-tokens", type=int, nargs=2, default=(10, 20), metavar=("MIN", "MAX"),
                   help="tokens of each tool result")
    p.add_argument("--max-delay-ms", type=float, default=50.0, help="arrival delays in [0, this]")
    p.add_argument("--group-size", type=int, default=1, help="episodes per group: a group shares its prompt and "
                   "arrives together (vs_trl's workload: --group-size 8 --prompt-tokens 330 --turns 3 4 "
                   "--turn-tokens 20 26 --tool-tokens 16 22)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", help="a Hugging Face model directory (default: a tiny random Qwen3 built here)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--max-batch", type=int, default=64, help="the JAX engine's max_batch")
    p.add_argument("--decode-steps", type=int, default=16, help="the JAX engine's decode_steps (continuous side)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each JAX side, alternated; figures of the median run, ratios the median of each run's")
    p.add_argument("--hf-batching", choices=("round", "grouped"), default="round")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (default: the cores this process may use, as XLA)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-sequential", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a smoke size, for the test")
    args = p.parse_args(argv)
    args.tail = None
    if args.tiny:
        args.episodes, args.prompt_tokens, args.turns = 3, 24, (2, 3)
        args.turn_tokens, args.tool_tokens, args.max_delay_ms = (4, 8), (2, 4), 10.0
        args.hidden, args.layers, args.intermediate, args.vocab = 64, 2, 128, 512
        args.max_batch, args.decode_steps, args.repeats = 4, 4, 1
    if args.mix == "long-tail":
        args.turn_tokens, args.tail = ((2, 4), (0.1, 16, 32)) if args.tiny else ((8, 32), (0.1, 256, 512))
    return args


def _build_model(args, tmp: str) -> Path:
    from jaxrl.tiny import build_tiny_model
    from jaxrl.tiny_tokenizer import build_tokenizer

    return build_tiny_model(Path(tmp) / "model", "qwen3", tokenizer=build_tokenizer(vocab_size=args.vocab),
                            hidden_size=args.hidden, num_layers=args.layers, intermediate_size=args.intermediate)


def main(argv=None) -> dict:
    args = parse_args(argv)
    threads = args.torch_threads or len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir) if args.model_dir else _build_model(args, tmp)
        cfg = json.loads((model_dir / "config.json").read_text())
        script = make_script(args.episodes, cfg["vocab_size"], args.prompt_tokens, tuple(args.turns),
                             tuple(args.turn_tokens), tuple(args.tool_tokens), args.max_delay_ms, args.seed, args.tail,
                             args.group_size)
        tokens = sum(ep.tokens for ep in script)
        figures = {
            "ratios": {},
            "episodes": args.episodes,
            "turns": sum(len(ep.turns) for ep in script),
            "generated_tokens": tokens,
            "prompt_tokens_mean": statistics.mean(len(ep.prompt) for ep in script),
            "mix": args.mix,
            "max_batch": args.max_batch,
            "decode_steps": args.decode_steps,
            "model": str(model_dir) if args.model_dir else
            f"tiny qwen3 hidden {args.hidden}, {args.layers} layers, mlp {args.intermediate}, vocab {args.vocab}",
            "threads": threads,
            "hf_batching": args.hf_batching,
            "load_before": {},
        }

        # Sequences as long as the script's longest; every batch size compiled up front. No untimed run,
        # and the prefix cache emptied before each run: earlier runs' sequences would serve its turns.
        longest = max(len(ep.prompt) + ep.tokens + sum(map(len, ep.tools)) for ep in script)
        engines = {side: JaxEngine(model_dir, max_batch=args.max_batch, max_seq_len=longest, decode_steps=steps,
                                   warm_up=True)
                   for side, steps in (("jax", args.decode_steps), ("jax_batch_sync", longest))}
        bandwidth = [memory_bandwidth()]
        runs = {side: [] for side in ("jax", "ceiling", "jax_batch_sync")}
        for _ in range(args.repeats):  # the sides alternate, so that the machine's load falls on all of them
            for side, engine in (("jax", engines["jax"]), ("ceiling", engines["jax"]),
                                 ("jax_batch_sync", engines["jax_batch_sync"])):
                engine.prefix.forget()
                figures["load_before"][side] = os.getloadavg()[0]
                runs[side].append(run_jax(engine, script) if side != "ceiling" else run_ceiling(
                    engine, args.max_batch, round(figures["prompt_tokens_mean"]), tokens, cfg["vocab_size"],
                    args.group_size))
        bandwidth.append(memory_bandwidth())
        # The one-batch run's rows attend on average to their prompt (their group's: read once for it) and
        # half their tokens.
        engine = engines["jax"]
        floor = decode_floor(engine.cfg, args.max_batch, round(figures["prompt_tokens_mean"] + tokens / args.max_batch / 2),
                             max(bandwidth), sum(x.size for x in jax.tree.leaves(engine.params)),
                             shared=round(figures["prompt_tokens_mean"]) if args.group_size > 1 else 0,
                             group=args.group_size)
        figures["floor"] = floor.figures()
        for engine in engines.values():
            asyncio.run(engine.close())
        del engines
        for side, results in runs.items():  # the median run
            figures[side] = sorted(results, key=lambda f: f["tok_s"])[len(results) // 2]
        for key, num, den in (("jax_over_ceiling", "jax", "ceiling"),
                              ("continuous_over_batch_sync", "jax", "jax_batch_sync")):
            figures["ratios"][key] = statistics.median(a["tok_s"] / b["tok_s"] for a, b in zip(runs[num], runs[den]))
        for side in ("ceiling", "jax"):
            figures["ratios"][f"{side}_over_floor"] = figures[side]["tok_s"] / floor.tok_s

        hf = None if args.skip_hf else HF(model_dir, threads)
        if hf is not None:
            grouped = args.hf_batching == "grouped"
            run_hf_turn_sync(hf, script, grouped)  # warm-up
            figures["load_before"]["hf_turn_sync"] = os.getloadavg()[0]
            figures["hf_turn_sync"] = run_hf_turn_sync(hf, script, grouped)
            figures["ratios"]["jax_over_hf_turn_sync"] = figures["jax"]["tok_s"] / figures["hf_turn_sync"]["tok_s"]
            if not args.skip_sequential:
                figures["load_before"]["hf_sequential"] = os.getloadavg()[0]
                figures["hf_sequential"] = run_hf_sequential(hf, script)
                figures["ratios"]["jax_over_hf_sequential"] = (
                    figures["jax"]["tok_s"] / figures["hf_sequential"]["tok_s"])

    for side in ("jax", "jax_batch_sync", "ceiling", "hf_turn_sync", "hf_sequential"):
        if side in figures:
            assert figures[side]["tokens"] == tokens, (side, figures[side]["tokens"], tokens)
    _print(figures)
    return figures


def _round(x):
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    return x


def _print(figures: dict) -> None:
    print(f"multi-turn bench: {figures['episodes']} episodes, {figures['turns']} turns ({figures['mix']}), "
          f"{figures['generated_tokens']} generated tokens, prompts ~{figures['prompt_tokens_mean']:.0f} tokens; "
          f"{figures['model']}; {figures['max_batch']} slots, {figures['decode_steps']} decode steps a call; "
          f"{figures['threads']} threads")
    for side in ("jax", "jax_batch_sync", "ceiling", "hf_turn_sync", "hf_sequential"):
        if side not in figures:
            continue
        f = figures[side]
        if side == "ceiling":
            extra = f"{f['rows']} rows of {f['prompt_tokens']} prompt tokens at once, {f['decode_calls']} device calls"
            latency = ""
        else:
            extra = (f"{f['decode_calls']} device calls ({f['rows_per_decode_call']:.1f} rows each, {f['shared_decode_calls']} "
                     "reading each group's prompt once), "
                     f"{f['compiles']} compiles in the timed run" if side.startswith("jax") else
                     f"{f['generate_calls']} generate calls")
            latency = f"turn p50 {f['turn_latency_median_ms']:8.1f} ms  "
        print(f"  {side:<14} {f['wall_s']:8.2f} s  {f['tok_s']:9.1f} tok/s  {latency}{extra}  "
              f"(load {figures['load_before'][side]:.2f})")
    f = figures["floor"]
    print(f"  floor of a {f['rows']}-row decode step at {f['context']} tokens of context: {f['tok_s']:.0f} tok/s "
          f"({f['bound']}-bound: {f['memory_ms']:.2f} ms to read {f['bytes'] / 1e6:.1f} MB at {f['bandwidth_gb_s']} GB/s, "
          f"{f['matmul_ms']:.2f} ms of matmuls at {f['matmul_gflop_s']} GFLOP/s)")
    for key, value in figures["ratios"].items():
        print(f"  {key:<28} {value:.2f}")
    print(json.dumps(_round(figures)), flush=True)


if __name__ == "__main__":
    restart_tuned()  # malloc as `jaxrl train` and the bridge run it (jaxrl.host_memory)
    main()
