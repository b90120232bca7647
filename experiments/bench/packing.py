"""Packed against padded learner steps, and PyTorch on the same packed rows, at a workload's lengths.

    python -m experiments.bench.packing [--workload tool|long-tail] [--pack-tokens N] [--pack-rows N]
        [--grad-accum N] [--steps 2] [--tiny]

The episodes: 256 (`--groups` x 8 samples sharing their group's prompt) drawn as the guess-number
tool workload of experiments.bench.vs_trl draws them: prompts of 45-63 tokens, completions (model
turns and two ~12-token tool results, which carry no loss) that reach the 128-token cap 85% of the
time and otherwise stop between 40 and 127; `long-tail`: the same with 10% of episodes 8x longer
(1,024 tokens). The model is vs_trl's: a Qwen3 of width 128, 4 layers, MLP 256, vocabulary 1,000.

Sides, each the GRPO step (dapo loss, AdamW) on the same batch, timed alternately (median of
`--steps` after one compiling step each):
  padded   the learner as `jaxrl train` runs it by default: rows `rollout.max_prompt_tokens` (256, as
           vs_trl sets it) + the completion width, each group's prompt run once (shared prompts),
           `--grad-accum` micro-batches;
  narrow   padded with `learner.prompt_widths: 4`: the prompts cut to the narrowest quarter of the
           width (rounded up to 128) that holds them, as a run with that setting cuts them;
  packed   `learner.pack_tokens` / `pack_rows`, as a run packs: each group's prompt laid out once,
           then its completions, each a segment that also sees the prompt (shared prompts);
  apart    packed with `shared_prompts: false`: each episode a segment of its own, its prompt with it;
  torch    transformers' Qwen3 (float32) on apart's rows, padding-free: position ids that restart
           per episode and no attention mask, from which transformers builds each row's block-causal
           mask (`masking_utils.find_packed_sequence_indices`; it has no shared prefixes).
The gradient norms of the five agree (the same loss). Printed per side: the token positions the
model runs (`computed_tokens`) against the real ones. Last line, JSON: `ratios` (packed over
padded, packed over torch, ..., in real tokens per second) first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

WORKLOADS = {"tool": 0.0, "long-tail": 0.1}
MODEL = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_layers=4)
TINY_MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2)


def episodes(groups: int, group_size: int, prompt_width: int, long_share: float, cap: int, vocab: int,
             seed: int = 0) -> dict[str, np.ndarray]:
    """The padded learner batch of the workload (the packed layout is made from it)."""
    rng = np.random.default_rng(seed)
    B = groups * group_size
    prompt_len = rng.integers(45 * prompt_width // 256, 64 * prompt_width // 256, groups).repeat(group_size)
    completion_len = np.where(rng.random(B) < 0.85, cap, rng.integers(cap * 5 // 16, cap, B))
    completion_len = np.where(rng.random(B) < long_share, 8 * cap, completion_len)
    C = int(completion_len.max())
    pmask = (np.arange(prompt_width)[None] >= prompt_width - prompt_len[:, None]).astype(np.int32)
    cmask = (np.arange(C)[None] < completion_len[:, None]).astype(np.int32)
    loss_mask = cmask.copy()
    tool = max(1, cap * 12 // 128)
    for b in range(B):  # two tool results: context, no loss
        for start in rng.integers(cap // 12, completion_len[b] - tool, 2):
            loss_mask[b, start:start + tool] = 0
    prompts = rng.integers(0, vocab, (groups, prompt_width)).repeat(group_size, 0) * pmask
    return {"prompt_BxP": prompts.astype(np.int32), "prompt_mask_BxP": pmask,
            "completion_BxC": (rng.integers(0, vocab, (B, C)) * cmask).astype(np.int32),
            "completion_mask_BxC": cmask, "loss_mask_BxC": loss_mask,
            "rewards_BxR": rng.random((B, 1)).astype(np.float32)}


class TorchPackedStep:
    """The same dapo step in PyTorch on the packed rows, padding-free."""

    def __init__(self, model, batch: dict, packed: dict, cfg):
        import torch
        import transformers

        from jaxrl.advantages import compute_advantages
        from jaxrl.models import save_pretrained

        self.torch, self.cfg = torch, cfg
        transformers.utils.logging.disable_progress_bar()
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(model, tmp)
            self.model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32,
                                                                           attn_implementation="sdpa")
        self.model.train()
        opt = cfg.optimizer
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=opt.learning_rate, betas=(opt.b1, opt.b2),
                                     eps=opt.eps, weight_decay=opt.weight_decay)
        B, C = batch["completion_BxC"].shape
        adv_B, _ = compute_advantages(batch["rewards_BxR"], cfg.group_size, cfg.advantages)
        n = int(packed["micro_batches"])
        rows = lambda k: packed[k][:n].reshape(-1, packed[k].shape[-1])  # noqa: E731
        target = rows("target_MxRxL")[:, 1:]
        real = target < B * C
        flat_loss = np.append(batch["loss_mask_BxC"].ravel(), 0)
        flat_adv = np.append(np.repeat(np.asarray(adv_B), C), 0)
        self.micro = []
        for m in range(n):
            r = slice(m * packed["tokens_MxRxL"].shape[1], (m + 1) * packed["tokens_MxRxL"].shape[1])
            t = target[r]
            self.micro.append({
                "ids": torch.tensor(rows("tokens_MxRxL")[r], dtype=torch.long),
                "positions": torch.tensor(rows("positions_MxRxL")[r], dtype=torch.long),
                "loss_mask": torch.tensor(np.where(real[r], flat_loss[t], 0), dtype=torch.float32),
                "adv": torch.tensor(np.where(real[r], flat_adv[t], 0), dtype=torch.float32)})
        self.tokens = float(batch["loss_mask_BxC"].sum())  # dapo's normaliser: the whole batch's

    def __call__(self) -> dict:
        torch, cfg = self.torch, self.cfg
        for mb in self.micro:
            logits = self.model(input_ids=mb["ids"], position_ids=mb["positions"], use_cache=False).logits[:, :-1]
            logp_all = torch.log_softmax(logits.float() / cfg.temperature, -1)
            logp = logp_all.gather(-1, mb["ids"][:, 1:, None])[..., 0]
            with torch.no_grad():  # the entropy metric, as our step logs it
                (-(logp_all.exp() * logp_all).sum(-1) * mb["loss_mask"]).sum().item()
            rho = torch.exp(logp - logp.detach())
            pg = -torch.minimum(rho * mb["adv"], rho.clamp(1 - cfg.loss.eps_low, 1 + cfg.loss.eps_high) * mb["adv"])
            ((pg * mb["loss_mask"]).sum() / self.tokens).backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optimizer.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"grad_norm": float(norm)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="tool")
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--pack-tokens", type=int, default=None, help="default: 512 (long-tail: 1,152)")
    p.add_argument("--pack-rows", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=None, help="padded micro-batches (default 1; long-tail 16)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    import jax
    import torch
    from flax import nnx

    from jaxrl.learner import Learner, prompt_widths
    from jaxrl.losses import LossConfig
    from jaxrl.models import Decoder
    from jaxrl.packing import dense_keys, pack
    from jaxrl.sharding import MeshConfig, make_mesh
    from jaxrl.tiny import tiny_config
    from jaxrl.train_step import LearnerConfig

    long_tail = args.workload == "long-tail"
    shape, cap, width = (TINY_MODEL, 16, 32) if args.tiny else (MODEL, 128, 256)
    groups = 2 if args.tiny else args.groups
    pack_tokens = args.pack_tokens or (128 if args.tiny else 1152 if long_tail else 512)
    grad_accum = args.grad_accum or (16 if long_tail and not args.tiny else 1)
    batch = episodes(groups, 8, width, WORKLOADS[args.workload], cap, shape["vocab_size"])
    B, C = batch["completion_BxC"].shape
    real = int(batch["prompt_mask_BxP"].sum() + batch["completion_mask_BxC"].sum())
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)

    mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    base = LearnerConfig(group_size=8, loss=LossConfig(loss_type="dapo", eps_high=0.28))
    model = Decoder(tiny_config("qwen3", **shape), nnx.Rngs(0))
    packed_cfg = base.__class__(**{**base.__dict__, "pack_tokens": pack_tokens, "pack_rows": args.pack_rows})
    apart_cfg = base.__class__(**{**packed_cfg.__dict__, "shared_prompts": False})
    layouts = {"packed": pack(batch, pack_tokens, args.pack_rows, group_size=8,
                              dense_keys=dense_keys(shape["hidden_size"])),  # as the packed learner lays it out
               "apart": pack(batch, pack_tokens, args.pack_rows)}
    # Before the learners move the weights: it copies them.
    torch_step = TorchPackedStep(model, batch, layouts["apart"], base)
    padded_cfg = base.__class__(**{**base.__dict__, "grad_accum": grad_accum})
    narrow_width = next(w for w in prompt_widths(width, 4) if w >= batch["prompt_mask_BxP"].sum(1).max())
    batches = {"padded": batch, "packed": batch, "apart": batch,
               "narrow": {**batch, **{k: batch[k][:, width - narrow_width:] for k in ("prompt_BxP", "prompt_mask_BxP")}}}
    sides = {"padded": Learner(model, padded_cfg, mesh), "narrow": Learner(model, padded_cfg, mesh),
             "packed": Learner(model, packed_cfg, mesh), "apart": Learner(model, apart_cfg, mesh)}
    grad_norms = {name: learner.update(batches[name])["grad_norm"] for name, learner in sides.items()}
    grad_norms["torch"] = torch_step()["grad_norm"]
    times = {name: [] for name in (*sides, "torch")}
    for _ in range(args.steps):
        for name, learner in sides.items():
            start = time.perf_counter()
            learner.update(batches[name])
            times[name].append(time.perf_counter() - start)
        start = time.perf_counter()
        torch_step()
        times["torch"].append(time.perf_counter() - start)
    step_s = {name: statistics.median(t) for name, t in times.items()}
    rows_used = {k: int(v["micro_batches"]) * args.pack_rows for k, v in layouts.items()}
    P = batch["prompt_BxP"].shape[1]
    computed = {"padded": groups * P + B * C, "narrow": groups * narrow_width + B * C,
                "packed": rows_used["packed"] * pack_tokens, "apart": rows_used["apart"] * pack_tokens,
                "torch": rows_used["apart"] * pack_tokens}
    figures = {
        "ratios": {"packed_over_padded": step_s["padded"] / step_s["packed"],
                   "packed_over_narrow": step_s["narrow"] / step_s["packed"],
                   "narrow_over_padded": step_s["padded"] / step_s["narrow"],
                   "packed_over_torch": step_s["torch"] / step_s["packed"],
                   "packed_over_apart": step_s["apart"] / step_s["packed"],
                   "apart_over_torch": step_s["torch"] / step_s["apart"]},
        "real_tokens_per_s": {name: real / s for name, s in step_s.items()},
        "step_s": step_s,
        "real_tokens": real,
        "computed_tokens": computed,
        "grad_norm_rel_diff": max(abs(v - grad_norms["padded"]) / grad_norms["padded"] for v in grad_norms.values()),
        "workload": args.workload, "episodes": B, "prompt_width": P, "narrow_prompt_width": narrow_width,
        "completion_width": C,
        "pack_tokens": pack_tokens, "pack_rows": args.pack_rows, "padded_grad_accum": grad_accum,
        "threads": threads, "load_average": round(os.getloadavg()[0], 2),
    }
    print(f"packing bench, {args.workload}: {B} episodes, {real} real tokens; padded rows {P} + {C} "
          f"(prompts shared), packed rows of {pack_tokens} x {args.pack_rows}; {threads} threads, "
          f"load {figures['load_average']}")
    for name in step_s:
        print(f"  {name:<7} {step_s[name]:8.3f} s/step  {figures['real_tokens_per_s'][name]:9.0f} real tok/s  "
              f"{computed[name]:8d} token positions computed")
    print(json.dumps(figures), flush=True)
    return figures


if __name__ == "__main__":
    from jaxrl.host_memory import restart_tuned

    restart_tuned()  # malloc as `jaxrl train` runs it
    main()
