"""A step's episodes laid end to end in rows of a fixed token budget (host side, numpy).

The learner batch keeps its padded (B, P) + (B, C) layout: losses, advantages and their normalisers
stay per row, exactly as without packing. Packing is the layout the model runs on: each episode's
real prompt and completion tokens become one segment of a row of `pack_tokens` tokens, with its own
positions (from 0) and attention within itself only; `target_RxL` says where each packed token's
logprob goes in the (B, C) layout (B * C where it is no completion token).

A group whose episodes share their prompt (`group_size` > 1, as GRPO's samples of one task do) can
lay it out once (`pack` picks the cheaper layout): a segment of its tokens but the last, then each
completion as a segment that starts with the prompt's last token (the completion's first logprob
comes from it) and also sees the prompt's segment (`prefix_RxL`: the one other segment each token
may attend to; its own otherwise). A group too long for a row is split, each part with its prompt.

Rows come in micro-batches of `rows` rows, longest units (groups, or episodes) first (first-fit
decreasing), so that a micro-batch of short ones attends over a short window: micro-batch m's
`window_M[m]` indexes `packed_windows(pack_tokens)`, the smallest that holds its longest segment and
whose `prefix_window` holds its longest shared prompt (read apart from the window, so the window
need not span a group). Where prompts are shared every unit starts at a query block's start.
Shapes depend only on (B, rows, pack_tokens): the micro-batches a step needs are a count
(`micro_batches`), and the arrays hold the most any step can need, one episode per row.
"""

from __future__ import annotations

import numpy as np

from jaxrl.models.decoder import QUERY_BLOCK, packed_windows, prefix_window, window_keys

# The arrays of one micro-batch (`micro_batches` is the step's count of them); an MoE batch's also
# `routes_MxRxLxU`, the recorded routes of its tokens.
PACKED_KEYS = ("tokens_MxRxL", "positions_MxRxL", "segments_MxRxL", "prefix_MxRxL", "target_MxRxL", "window_M")


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


def dense_keys(hidden_size: int) -> int:
    """A token's dense work (projections and MLP) counted in attention keys, as `pack` weighs a layout's
    tokens against its windows: ~2 x the hidden size on CPU."""
    return 2 * hidden_size


def _units(prompts: list[np.ndarray], completions: list[np.ndarray], group_size: int, L: int) -> list[tuple]:
    """(prompt or None, [episode, ...], tokens) per unit laid out together: a group sharing its prompt
    (split where it outgrows a row: p - 1 + sum(1 + c) tokens), or one episode with its own prompt."""
    units = []
    B = len(prompts)
    for g in range(0, B, group_size):
        members = [b for b in range(g, min(g + group_size, B)) if len(completions[b])]
        shared = (group_size > 1 and len(members) > 1 and len(prompts[members[0]]) > 0
                  and all(np.array_equal(prompts[b], prompts[members[0]]) for b in members))
        if not shared:
            units += [(None, [b], len(prompts[b]) + len(completions[b])) for b in members]
            continue
        prompt = prompts[members[0]]
        part, n = [], len(prompt) - 1
        for b in members:
            if part and n + 1 + len(completions[b]) > L:
                units.append((prompt, part, n))
                part, n = [], len(prompt) - 1
            part.append(b)
            n += 1 + len(completions[b])
        units.append((prompt, part, n))
    return units


def _window(own: int, prompt: int, L: int) -> int:
    """The index of the smallest of `packed_windows(L)` whose query blocks reach back over a
    segment of `own` tokens, and whose `prefix_window` holds a shared prompt of `prompt` (0: none)."""
    windows = packed_windows(L)
    return next(i for i, w in enumerate(windows)
                if w == L or (w >= own + QUERY_BLOCK - 1 and prefix_window(w, L) >= prompt))


def _place(length_U: np.ndarray, window_U: np.ndarray, L: int, rows: int) -> tuple[list[list[int]], np.ndarray, int]:
    """First-fit decreasing: the longest units open rows first; each later one takes the first row
    with room. Rows keep their opening order, so micro-batches run longest first. Returns the
    units of each row, each micro-batch's window (the widest `window_U` of its units, an index of
    `packed_windows(L)`) and their count."""
    free: list[int] = []
    placed: list[list[int]] = []
    for u in np.argsort(-length_U, kind="stable"):
        n = int(length_U[u])
        row = next((r for r, room in enumerate(free) if room >= n), None)
        if row is None:
            free.append(L)
            placed.append([])
            row = len(free) - 1
        free[row] -= n
        placed[row].append(int(u))
    micro_batches = -(-len(placed) // rows)
    window_m = [max(int(window_U[u]) for row in placed[m * rows:(m + 1) * rows] for u in row)
                for m in range(micro_batches)]
    return placed, np.asarray(window_m, np.int32), micro_batches


def pack(batch: dict[str, np.ndarray], pack_tokens: int, rows: int, first_row: int = 0,
         total_rows: int | None = None, group_size: int = 1, dense_keys: int = 256) -> dict[str, np.ndarray]:
    """The packed layout of `batch` (prompts left-padded, completions right-padded), in micro-batches
    of `rows` rows of `pack_tokens` tokens. A process's share of a global batch packs its own rows:
    they are rows `first_row`... of `total_rows` (whole groups), which `target_MxRxL` counts in.

    With `group_size` > 1, groups of consecutive rows that share their prompt lay it out once where
    that is the cheaper layout: fewer tokens, but each query block also reads its prompt's keys
    (`prefix_window`) and each unit starts at a block's start. The cost of a layout: the token
    positions it runs, each a token's dense work (`dense_keys`: the function of that name) plus the
    keys a query reads at its micro-batch's window (`window_keys`)."""
    check_fits(batch, pack_tokens)
    prompt_BxP, pmask_BxP = np.asarray(batch["prompt_BxP"]), np.asarray(batch["prompt_mask_BxP"]).astype(bool)
    comp_BxC, cmask_BxC = np.asarray(batch["completion_BxC"]), np.asarray(batch["completion_mask_BxC"]).astype(bool)
    B, C = comp_BxC.shape
    total = B if total_rows is None else total_rows
    L = pack_tokens
    prompts = [prompt_BxP[b][pmask_BxP[b]] for b in range(B)]
    c_idx = [np.flatnonzero(cmask_BxC[b]) for b in range(B)]
    windows = np.asarray(packed_windows(L))
    best = None
    for size in sorted({1, group_size}):
        units = _units(prompts, c_idx, size, L)
        if size > 1 and all(prompt is None for prompt, *_ in units):
            break  # no group shares its prompt: the same units as apart
        # Shared prompts are read per query block from a block's start: every unit starts at one.
        length_U = np.array([-(-n // QUERY_BLOCK) * QUERY_BLOCK if size > 1 else n for *_, n in units], np.int64)
        window_U = np.array([_window(n, 0, L) if prompt is None else
                             _window(max(len(prompt) - 1, *(1 + len(c_idx[b]) for b in members)), len(prompt) - 1, L)
                             for prompt, members, n in units])
        placed, window_M, micro_batches = _place(length_U, window_U, L, rows)
        keys_W = np.array([window_keys(w, L) for w in windows])
        cost = rows * L * float((dense_keys + keys_W[window_M]).sum())
        if best is None or cost < best[0]:
            best = (cost, units, placed, window_M, micro_batches)
    _, units, placed, window_m, micro_batches = best
    M = max_micro_batches(B, rows)
    shape = (M * rows, L)
    tokens, positions = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    segments, prefix, target = np.zeros(shape, np.int32), np.zeros(shape, np.int32), np.full(shape, total * C, np.int32)
    # An MoE batch's recorded routes go where their tokens go (padding: the dtype's `no_route`).
    routed = "completion_routes_BxCxU" in batch
    if routed:
        proutes_BxPxU, croutes_BxCxU = np.asarray(batch["prompt_routes_BxPxU"]), np.asarray(batch["completion_routes_BxCxU"])
        prompt_routes = [proutes_BxPxU[b][pmask_BxP[b]] for b in range(B)]
        routes = np.full((*shape, croutes_BxCxU.shape[-1]), np.iinfo(croutes_BxCxU.dtype).max, croutes_BxCxU.dtype)

    def lay(r, at, s, context, b, first_position, see):
        """Episode b's completion after `context` (the end of its prompt) as segment s from `at`; returns
        where it ends."""
        n = len(context) + len(c_idx[b])
        tokens[r, at:at + len(context)] = context
        tokens[r, at + len(context):at + n] = comp_BxC[b, c_idx[b]]
        if routed:
            routes[r, at:at + len(context)] = prompt_routes[b][len(prompt_routes[b]) - len(context):]
            routes[r, at + len(context):at + n] = croutes_BxCxU[b, c_idx[b]]
        positions[r, at:at + n] = first_position + np.arange(n)
        segments[r, at:at + n], prefix[r, at:at + n] = s, see
        target[r, at + len(context):at + n] = (first_row + b) * C + c_idx[b]
        return at + n

    aligned = any(prompt is not None for prompt, *_ in units)
    for r, row_units in enumerate(placed):
        at, s = 0, 0
        for u in row_units:
            prompt, members, _ = units[u]
            at = -(-at // QUERY_BLOCK) * QUERY_BLOCK if aligned else at
            s += 1
            if prompt is None:
                at = lay(r, at, s, prompts[members[0]], members[0], 0, s)
                continue
            head = len(prompt) - 1
            tokens[r, at:at + head], positions[r, at:at + head] = prompt[:-1], np.arange(head)
            if routed:
                routes[r, at:at + head] = prompt_routes[members[0]][:-1]
            segments[r, at:at + head] = prefix[r, at:at + head] = shared = s
            at += head
            for b in members:
                s += 1
                at = lay(r, at, s, prompt[-1:], b, head, shared)
    window_M = np.zeros(M, np.int32)
    window_M[:micro_batches] = window_m
    packed = {"tokens_MxRxL": tokens.reshape(M, rows, L), "positions_MxRxL": positions.reshape(M, rows, L),
              "segments_MxRxL": segments.reshape(M, rows, L), "prefix_MxRxL": prefix.reshape(M, rows, L),
              "target_MxRxL": target.reshape(M, rows, L), "window_M": window_M, "micro_batches": np.int32(micro_batches)}
    if routed:
        packed["routes_MxRxLxU"] = routes.reshape(M, rows, L, -1)
    return packed
