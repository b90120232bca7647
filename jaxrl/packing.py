"""A step's episodes laid end to end in rows of a fixed token budget (host side, numpy).

The learner batch keeps its padded (B, P) + (B, C) layout: losses, advantages and their normalisers
stay per row, exactly as without packing. Packing is the layout the model runs on: each episode's
real prompt and completion tokens become one segment of a row of `pack_tokens` tokens, with its own
positions (from 0) and attention within itself only; `target_RxL` says where each packed token's
logprob goes in the (B, C) layout (B * C where it is no completion token).

Rows come in micro-batches of `rows` rows, longest episodes first (first-fit decreasing), so that a
micro-batch of short episodes attends over a short window: micro-batch m's `window_M[m]` indexes
`attention_windows(pack_tokens)`, the smallest that holds its longest segment. Shapes depend only on
(B, rows, pack_tokens): the micro-batches a step needs are a count (`micro_batches`), and the arrays
hold the most any step can need, one episode per row.
"""

from __future__ import annotations

import numpy as np

from jaxrl.models.decoder import QUERY_BLOCK, packed_windows

PACKED_KEYS = ("tokens_MxRxL", "positions_MxRxL", "segments_MxRxL", "target_MxRxL", "window_M", "micro_batches")


def max_micro_batches(batch_rows: int, rows: int) -> int:
    """Micro-batches a step may need: every episode in a row of its own."""
    return -(-batch_rows // rows)


def segment_lengths(batch: dict[str, np.ndarray]) -> np.ndarray:
    """Real tokens (prompt + completion) of each row; 0 for rows without completion tokens."""
    completion_B = np.asarray(batch["completion_mask_BxC"]).sum(1)
    return np.where(completion_B > 0, np.asarray(batch["prompt_mask_BxP"]).sum(1) + completion_B, 0)


def check_fits(batch: dict[str, np.ndarray], pack_tokens: int) -> None:
    longest = int(segment_lengths(batch).max(initial=0))
    if longest > pack_tokens:
        raise ValueError(f"an episode of {longest} tokens (prompt + completion) does not fit a packed row of "
                         f"learner.pack_tokens={pack_tokens}; raise it to at least the prompt and completion "
                         f"widths together")


def pack(batch: dict[str, np.ndarray], pack_tokens: int, rows: int, first_row: int = 0,
         total_rows: int | None = None) -> dict[str, np.ndarray]:
    """The packed layout of `batch` (prompts left-padded, completions right-padded), in micro-batches
    of `rows` rows of `pack_tokens` tokens. A process's share of a global batch packs its own rows:
    they are rows `first_row`... of `total_rows`, which `target_MxRxL` counts in."""
    check_fits(batch, pack_tokens)
    prompt_BxP, pmask_BxP = np.asarray(batch["prompt_BxP"]), np.asarray(batch["prompt_mask_BxP"]).astype(bool)
    comp_BxC, cmask_BxC = np.asarray(batch["completion_BxC"]), np.asarray(batch["completion_mask_BxC"]).astype(bool)
    B, C = comp_BxC.shape
    total = B if total_rows is None else total_rows
    L = pack_tokens
    length_B = segment_lengths(batch)
    # First-fit decreasing: the longest episodes open rows first; each later one takes the first
    # row with room. Rows keep their opening order, so micro-batches run longest first.
    order = np.argsort(-length_B, kind="stable")
    free: list[int] = []
    placed: list[list[int]] = []
    for b in order:
        n = int(length_B[b])
        if n == 0:
            break
        row = next((r for r, room in enumerate(free) if room >= n), None)
        if row is None:
            free.append(L)
            placed.append([])
            row = len(free) - 1
        free[row] -= n
        placed[row].append(int(b))
    M = max_micro_batches(B, rows)
    shape = (M * rows, L)
    tokens, positions = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    segments, target = np.zeros(shape, np.int32), np.full(shape, total * C, np.int32)
    for r, row_episodes in enumerate(placed):
        at = 0
        for s, b in enumerate(row_episodes, start=1):
            prompt = prompt_BxP[b][pmask_BxP[b]]
            c_idx = np.flatnonzero(cmask_BxC[b])
            n = len(prompt) + len(c_idx)
            tokens[r, at:at + len(prompt)] = prompt
            tokens[r, at + len(prompt):at + n] = comp_BxC[b, c_idx]
            positions[r, at:at + n] = np.arange(n)
            segments[r, at:at + n] = s
            target[r, at + len(prompt):at + n] = (first_row + b) * C + c_idx
            at += n
    micro_batches = -(-len(placed) // rows)
    windows = packed_windows(L)
    window_M = np.zeros(M, np.int32)
    for m in range(micro_batches):
        longest = max(int(length_B[b]) for row in placed[m * rows:(m + 1) * rows] for b in row)
        # A query block's keys end with it: the window must reach back to its segment's start.
        need = longest + QUERY_BLOCK - 1
        window_M[m] = next(i for i, w in enumerate(windows) if w >= need or w == windows[-1])
    return {"tokens_MxRxL": tokens.reshape(M, rows, L), "positions_MxRxL": positions.reshape(M, rows, L),
            "segments_MxRxL": segments.reshape(M, rows, L), "target_MxRxL": target.reshape(M, rows, L),
            "window_M": window_M, "micro_batches": np.int32(micro_batches)}
