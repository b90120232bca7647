"""The JAX engine's host side, as vLLM v1's scheduler splits it: `schedule()` returns a plain `Plan` of
one tick (rows ended, moved, new; prefix-cache hits), the device runs it, `update_from_output()`
applies what the device sampled. Plain Python and numpy, no JAX: the plan is unit-tested on its own.

Slots. `max_batch` decode slots; a tick decodes only a power-of-two prefix of them, so live rows
move down to fill the first ones. Rows that ended in the last tick hand their keys and values to the
prefix pool and free their slots; waiting rows take free slots, prefilled from whatever the pool holds
of their prompt. Per-slot bookkeeping (the row's sampled tokens, logprobs and versions so far, the
version of its next-token logits, the pool row its sequence goes to) lives in numpy arrays written
from each tick's output at once; a `Row`'s lists are filled when it ends.

Prefix pool. `rows` pool rows keep recent sequences' keys and values, so that an episode's next turn
(whose prompt extends its last prompt and completion) prefills only its new tokens. A pool row is
found by hashes of its token blocks, vLLM's prefix caching: block k's hash chains blocks 0..k, and an
index maps each hash to the pool rows holding that prefix. A prompt walks its blocks' hashes down the
index; at the deepest hit, the row sharing the longest prefix (compared token by token past the last
whole block) is reused for that many tokens. Rows of one tick with the same prompt prefill it once
(the first is their leader). A row being generated has claimed the pool row its sequence goes to when
it ends (the one it extends, when that one is free); otherwise the least recently used row. Everything
is forgotten when the weights change, and a row that saw two versions is not kept. A model's sliding
layers keep only a window of each sequence (`jaxrl.models.decoder.RingSlots`): a pool row longer than the
window serves only a prompt that continues its whole sequence (an episode's next turn), as vLLM's
sliding-window layers hit only where the blocks of the window before the hit are still cached.

Groups. The rows of a GRPO group share their prompt, and each slot holds a copy; a decode reads it once
for the group when `groups` finds the rows' shared whole blocks (keys of the same weights) enough for
what each row holds past them to fit a narrow window.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import numpy as np

NO_STOP = -2  # stop-id padding: no token has it


@dataclasses.dataclass(eq=False)
class Row:
    """One completion to generate, with its own sampling settings, and what it sampled once it ended."""

    prompt: list[int]
    max_tokens: int
    seed: int  # up to 64 bits: the row's random stream
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    stop_ids: tuple[int, ...] = ()  # token ids that end the row
    tokens: list[int] = dataclasses.field(default_factory=list)  # up to and including the stop token
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)  # the weights behind each token's logits
    finish_reason: str | None = None  # "stop" or "length" once it ended
    # An MoE model's: the route of every token fed to the model (the prompt's and the tokens but the
    # last), (len(prompt) + len(tokens) - 1, route width), once it ended
    routes: np.ndarray | None = None


# The fewest rows a tick runs: a decode step of one row costs about what one of eight does (the
# call's overhead on a CPU, the weights' reads on an accelerator), and every smaller size would be
# two more programs to compile before serving.
MIN_BATCH = 8


def bucket(n: int) -> int:
    """The power of two at or above n (n >= 1), and at least MIN_BATCH."""
    return max(MIN_BATCH, 1 << max(n - 1, 0).bit_length())


def prefill_block_rows(batch: int) -> int:
    """Rows prefilled together: an eighth of the batch, so that a batch of groups that share
    their prompts (one row to prefill in each group of 8) prefills about 1/8 of its rows."""
    return max(1, batch // 8)


def prefill_order(prompt_len: np.ndarray, cached: np.ndarray, leader: np.ndarray, real_rows: int,
                  chunk: int, tail: int, width: int) -> tuple[np.ndarray, np.ndarray, np.int32, np.ndarray, np.int32]:
    """The batch's rows reordered for the prefill: (order, the rows with a prompt rest to prefill
    first, longest rest first; then for each of the two passes, `chunk` tokens a step and `tail`
    tokens a step: block_I, for each step the block of `prefill_block_rows` rows (of the new order) it
    runs, and the number of steps). A row takes chunks while more than two tails of its rest are
    left, then tails (`prefill_steps`). A block takes as many steps of each as its longest rest needs.
    Rows that copy a leader's prefill and padding rows (from `real_rows` on) prefill nothing."""
    B = len(prompt_len)
    R = prefill_block_rows(B)
    rows = np.arange(B)
    todo = (rows < real_rows) & (leader == rows) & (cached < prompt_len)
    rest = prompt_len - np.minimum(cached, prompt_len)
    first = rows[todo][np.argsort(-rest[todo], kind="stable")]  # like rests in a block
    order = np.concatenate([first, rows[~todo]]).astype(np.int32)
    blocks = -(-len(first) // R)
    passes = []
    for need, most in zip(prefill_steps(rest[first], chunk, tail), (-(-width // chunk), 2)):
        longest = np.zeros(blocks, np.int64)
        if blocks:
            np.maximum.at(longest, np.arange(len(first)) // R, need)
        steps = np.repeat(np.arange(blocks), longest)
        block_I = np.zeros(-(-B // R) * most, np.int32)  # a last, partial block is slid back in place
        block_I[:len(steps)] = steps
        passes += [block_I, np.int32(len(steps))]
    return (order, *passes)


def prefill_steps(rest: np.ndarray, chunk: int, tail: int) -> tuple[np.ndarray, np.ndarray]:
    """The steps of `chunk` tokens, then of `tail` tokens (at most two), that prefill rests of `rest`
    tokens: a chunk while more than two tails are left (the insert's rule). A step costs about a fixed
    part plus its tokens: a continuing turn's few new tokens do not pay a whole chunk, nor a long
    prompt's last tokens a step per tail."""
    chunks = np.maximum(-(-(rest - 2 * tail) // chunk), 0)
    left = np.maximum(rest - chunks * chunk, 0)
    return chunks, -(-left // tail)


class PrefixIndex:
    """Which pool row holds which token sequence, looked up by chained hashes of `block`-token blocks.
    Host bookkeeping only: the keys and values live on the device, in the pool rows named here."""

    def __init__(self, rows: int, block: int, sliding_window: int = 0):
        self.rows, self.block = rows, block
        self.sliding_window = sliding_window  # of the model's sliding layers; 0: none
        self.scratch = rows  # the pool's last row: where nothing is kept
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0}
        self.clock = 0
        self.forget()

    def forget(self) -> None:
        """Forgets every row (new weights)."""
        self.sequence: list[np.ndarray | None] = [None] * self.rows
        self.hashes: list[list[int]] = [[] for _ in range(self.rows)]
        self.index: dict[int, dict[int, None]] = {}  # block hash -> pool rows with that prefix (insertion order)
        self.claimed = np.zeros(self.rows, bool)
        self.used = np.zeros(self.rows, np.int64)  # the clock of each row's last claim; 0: never

    def block_hashes(self, tokens: np.ndarray, known: list[int] = ()) -> list[int]:
        """Chained hashes of the whole blocks of `tokens`; `known`: those of a prefix, reused."""
        out = list(known[:len(tokens) // self.block])
        h = out[-1] if out else 0
        for start in range(len(out) * self.block, len(tokens) - self.block + 1, self.block):
            h = hash((h, tokens[start:start + self.block].tobytes()))
            out.append(h)
        return out

    def lookup(self, tokens: np.ndarray, hashes: list[int]) -> tuple[int, int]:
        """(pool row, tokens of `tokens` it holds) for the row sharing the longest prefix that it can serve;
        (scratch, 0) if none shares a whole block. At most len(tokens) - 1 tokens: the last one is prefilled
        for its logits. Rows sharing fewer blocks are looked at only where none sharing more can serve."""
        levels = []  # the rows sharing each number of whole blocks
        for h in hashes:
            found = self.index.get(h)
            if not found:
                break
            levels.append(found)
        deeper: dict[int, None] = {}
        for depth in range(len(levels), 0, -1):
            # A row that shares more blocks was looked at already.
            best, n = self._longest(tokens, [r for r in levels[depth - 1] if r not in deeper], depth * self.block)
            if n:
                return best, n
            deeper = levels[depth - 1]
        return self.scratch, 0

    def _longest(self, tokens: np.ndarray, rows: list[int], start: int) -> tuple[int, int]:
        """(row, tokens it holds) for the row of `rows` (each sharing `tokens`' first `start`) sharing the
        most, of those it can serve; (scratch, 0) if none."""
        best, best_len = self.scratch, 0
        for row in reversed(rows):  # the latest first: equal prefixes keep the row most recently written
            seq = self.sequence[row]
            end = min(len(seq), len(tokens) - 1)
            tail = np.flatnonzero(seq[start:end] != tokens[start:end])
            n = min(start + (tail[0] if len(tail) else max(end - start, 0)), end)
            if self.sliding_window and len(seq) > self.sliding_window and n < len(seq) - 1:
                # Its sliding layers kept only the last window of its sequence, not the one before n (at
                # n = len - 1 the first new token's window reaches back to len - window: still kept).
                continue
            if n > best_len:
                best, best_len = row, n
            if n >= end:
                break
        return best, best_len

    def claim(self, preferred: int) -> int:
        """Claims `preferred` if free, else the least recently used free row (empty ones first); scratch if
        none is free."""
        self.clock += 1
        if preferred != self.scratch and not self.claimed[preferred]:
            row = preferred
        else:
            free = np.flatnonzero(~self.claimed)
            if not len(free):
                return self.scratch
            empty = np.array([self.sequence[r] is None for r in free])
            row = int(free[np.lexsort((self.used[free], ~empty))[0]])
        self.claimed[row] = True
        self.used[row] = self.clock
        return row

    def keep(self, row: int, sequence: np.ndarray | None, hashes: list[int] = ()) -> None:
        """Pool row `row` now holds `sequence` (None: nothing worth keeping), whose first whole blocks
        have `hashes`; its claim ends."""
        if row == self.scratch:
            return
        self.claimed[row] = False
        for h in self.hashes[row]:
            holders = self.index.get(h)
            if holders is not None:
                holders.pop(row, None)
                if not holders:
                    del self.index[h]
        self.sequence[row] = sequence
        self.hashes[row] = [] if sequence is None else self.block_hashes(sequence, hashes)
        for h in self.hashes[row]:
            self.index.setdefault(h, {})[row] = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """One tick. Applied in this order by the device: save slots `save_slot` to pool rows `save_row`
    and free them; prefill the new rows (`new`, each from pool row `src` of which `cached` tokens are
    its prompt's first ones; a row whose `leader` is another copies that row's prefill) into slots
    `slot`; move slots `move_from` to `move_to`; then decode the first `batch` slots (0: no decode).
    `span`: the cache slots in use of the rows saved (to a pool row that keeps them) or moved."""

    save_slot: np.ndarray
    save_row: np.ndarray
    move_from: np.ndarray
    move_to: np.ndarray
    new: list[Row]
    slot: np.ndarray
    src: np.ndarray
    cached: np.ndarray
    leader: np.ndarray
    batch: int
    span: int

    @property
    def inserts(self) -> bool:
        return bool(len(self.save_slot) or len(self.move_from) or self.new)


class Groups(NamedTuple):
    """A decode's rows grouped by the prompt prefix they share, so that the decode reads each group's
    prefix once (`jaxrl.models.decoder.shared_prefix_attention`): the first `length[u]` slots of slot
    `src[u]`, which every member of group u holds too. Slot b of the batch is member rank[b] of
    group[b]; `members` (U, n) lists each group's slots (padding: its first). Free slots of the batch
    are nobody's member (group 0, rank 0: what they compute is unused). Numpy arrays, passed to the
    device call as they are."""

    src: np.ndarray  # (U,)
    length: np.ndarray  # (U,)
    members: np.ndarray  # (U, n)
    group: np.ndarray  # (b,)
    rank: np.ndarray  # (b,)


def group_capacity(batch: int) -> tuple[int, int]:
    """(groups, rows per group) a decode of `batch` slots may share prefixes over: a batch of GRPO
    groups of 8 (or of a multiple of 8)."""
    return max(1, batch // MIN_BATCH), MIN_BATCH


class Scheduler:
    """The rows in each slot and those waiting for one, and the prefix pool's index. Not thread-safe."""

    def __init__(self, max_batch: int, max_seq_len: int, pool_rows: int, block: int = 16, sliding_window: int = 0):
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.prefix = PrefixIndex(pool_rows, block, sliding_window)
        self.waiting: collections.deque[Row] = collections.deque()
        self.stats = {"decode_calls": 0, "shared_decode_calls": 0, "insert_calls": 0, "rows": 0, "tokens": 0}
        self.version: int | None = None
        self.reset()

    def reset(self) -> None:
        """Empties every slot and the pool (after a failed device call)."""
        B, M = self.max_batch, self.max_seq_len
        self.rows: list[Row | None] = [None] * B
        self.prompt: list[np.ndarray | None] = [None] * B  # each slot's prompt, as an array
        self.prompt_hashes: list[list[int]] = [[] for _ in range(B)]
        self.keep_row = np.full(B, self.prefix.scratch, np.int32)  # where each slot's sequence goes when it ends
        self.logits_version = np.zeros(B, np.int64)  # the weights that computed each slot's next-token logits
        self.prompt_version = np.zeros(B, np.int64)  # the weights that computed each slot's prompt keys
        self.length = np.zeros(B, np.int32)  # tokens sampled so far
        self.tokens = np.zeros((B, M), np.int32)
        self.logprobs = np.zeros((B, M), np.float32)
        self.versions = np.zeros((B, M), np.int64)
        self.ended: list[tuple[int, int, np.ndarray | None, list[int]]] = []  # (slot, pool row, sequence, hashes)
        self.prefix.forget()

    def add(self, rows: list[Row]) -> None:
        """Queues rows for a slot; each must fit max_seq_len."""
        for row in rows:
            if not row.prompt or row.max_tokens < 1 or len(row.prompt) + row.max_tokens > self.max_seq_len:
                raise ValueError(f"a row needs a prompt and 1 <= max_tokens, within max_seq_len "
                                 f"{self.max_seq_len} tokens in all; got {len(row.prompt)} + {row.max_tokens}")
        self.waiting.extend(rows)

    def drop(self, rows: list[Row]) -> None:
        """Forgets rows no one waits for any more, waiting or in a slot."""
        gone = set(rows)
        self.waiting = collections.deque(r for r in self.waiting if r not in gone)
        for s, row in enumerate(self.rows):
            if row in gone:
                self._free(s)
                self.prefix.keep(int(self.keep_row[s]), None)
                self.ended.append((s, self.prefix.scratch, None, []))

    def busy(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.rows)

    def batch(self, rows: int) -> int:
        return min(bucket(rows), self.max_batch)

    def in_use(self, slots) -> int:
        """The cache slots the longest of these slots' sequences holds (prompt and tokens sampled)."""
        return max((len(self.prompt[s]) + int(self.length[s]) for s in slots if self.rows[s] is not None), default=0)

    def groups(self, batch: int, steps: int, own: int, width: int) -> Groups | None:
        """The first `batch` slots' rows grouped for a decode of `steps` tokens that reads, of each slot, only
        the `own` slots past its group's prefix (of `width` in all); None where they do not fit
        `group_capacity(batch)`, or where no two rows share a prefix.

        A group's prefix is whole blocks of its rows' prompts, the same tokens with keys of the same weights.
        The decode's cost is fixed by its widths, so the fewest groups whose rows fit do: rows sorted by
        their prompts' block hashes (rows sharing a prefix then sit together) are cut, in that order, into
        groups of at most n rows that share enough blocks for each row's tokens past them to fit `own`; a
        group's prefix is the fewest such blocks (a narrower prefix window)."""
        U, n = group_capacity(batch)
        block = self.prefix.block
        slots = sorted((s for s in range(batch) if self.rows[s] is not None),
                       key=lambda s: (self.prompt_version[s], self.prompt_hashes[s]))
        need = {s: max(0, -(-(len(self.prompt[s]) + int(self.length[s]) + steps - own) // block)) for s in slots}
        chunks: list[tuple[list[int], int]] = []  # (slots, blocks of prefix)
        for s in slots:
            hashes = self.prompt_hashes[s]
            if chunks and len(chunks[-1][0]) < n:
                rows, shared = chunks[-1]
                first = rows[0]
                if self.prompt_version[first] == self.prompt_version[s]:
                    shared = next((d for d in range(min(shared, len(hashes)), 0, -1)
                                   if hashes[d - 1] == self.prompt_hashes[first][d - 1]), 0)
                    if shared >= max(need[r] for r in rows + [s]):
                        chunks[-1] = (rows + [s], shared)
                        continue
            if need[s] > len(hashes):
                return None
            chunks.append(([s], len(hashes)))
        lengths = [max(need[r] for r in rows) * block for rows, _ in chunks]
        if len(chunks) > U or max(lengths) + own > width or not any(
                len(rows) > 1 and length for (rows, _), length in zip(chunks, lengths)):
            return None
        src, length = np.zeros(U, np.int32), np.zeros(U, np.int32)
        table = np.zeros((U, n), np.int32)
        group, rank = np.zeros(batch, np.int32), np.zeros(batch, np.int32)
        length[:len(lengths)] = lengths
        for u, (rows, _) in enumerate(chunks):
            src[u], table[u] = rows[0], rows[0]
            table[u, :len(rows)] = rows
            group[rows], rank[rows] = u, np.arange(len(rows))
        self.stats["shared_decode_calls"] += 1
        return Groups(src, length, table, group, rank)

    def schedule(self, version: int) -> Plan:
        """The next tick's plan, with weights `version`; the slots' host state moves as the plan does."""
        scratch = self.prefix.scratch
        if version != self.version:  # cached keys and values of other weights
            self.prefix.forget()
            self.keep_row[:] = scratch
            self.ended = [(s, scratch, None, []) for s, _, _, _ in self.ended]
            self.version = version
        ended, self.ended = self.ended, []
        for _, row, sequence, hashes in ended:
            self.prefix.keep(row, sequence, hashes)
        live = [s for s, r in enumerate(self.rows) if r is not None]
        new = [self.waiting.popleft() for _ in range(min(len(self.waiting), self.max_batch - len(live)))]
        b = self.batch(len(live) + len(new)) if live or new else 0
        free = [s for s in range(b) if self.rows[s] is None]
        moves = list(zip([s for s in live if s >= b], free))  # live rows into the first b slots
        for src, dst in moves:
            self._move(src, dst)
        span = max([len(sequence) for _, _, sequence, _ in ended if sequence is not None]
                   + [self.in_use([dst for _, dst in moves])], default=0)
        slots = np.asarray(free[len(moves):len(moves) + len(new)], np.int32)
        src, cached, leader = (np.full(len(new), scratch, np.int32), np.zeros(len(new), np.int32),
                               np.arange(len(new), dtype=np.int32))
        first: dict[bytes, int] = {}
        for k, (row, s) in enumerate(zip(new, slots)):
            prompt = np.asarray(row.prompt, np.int32)
            hashes = self.prefix.block_hashes(prompt)
            self.prefix.stats["prompt_tokens"] += len(prompt)
            key = prompt.tobytes()
            if key in first:  # a row of this tick with the same prompt prefills it
                leader[k] = first[key]
                cached[k] = len(prompt)
                best = scratch
            else:
                first[key] = k
                best, cached[k] = self.prefix.lookup(prompt, hashes)
                src[k] = best
            self.prefix.stats["cached_tokens"] += int(cached[k])
            # The episode's next turn extends its row in place when no other row claimed it.
            self.keep_row[s] = self.prefix.claim(best)
            self.rows[s], self.prompt[s], self.prompt_hashes[s] = row, prompt, hashes
            self.length[s], self.logits_version[s], self.prompt_version[s] = 0, version, version
        self.stats["rows"] += len(new)
        self.stats["insert_calls"] += bool(ended or moves or new)
        return Plan(np.asarray([s for s, _, _, _ in ended], np.int32), np.asarray([r for _, r, _, _ in ended], np.int32),
                    np.asarray([s for s, _ in moves], np.int32), np.asarray([d for _, d in moves], np.int32),
                    new, slots, src, cached, leader, b, span)

    def update_from_output(self, plan: Plan, tokens_bxN: np.ndarray, logprobs_bxN: np.ndarray, live_b: np.ndarray,
                           version: int) -> list[Row]:
        """Applies a decode of the plan's first `batch` slots (tokens -1 where a slot sampled nothing; `live_b`:
        whether each slot's row goes on); returns the rows that ended."""
        b = plan.batch
        n_b = (tokens_bxN >= 0).sum(-1)
        sampled = n_b > 0
        # Tokens are a prefix of each row of the output: written at each slot's length on.
        s_idx, t_idx = np.nonzero(tokens_bxN >= 0)
        at = self.length[s_idx] + t_idx
        self.tokens[s_idx, at] = tokens_bxN[s_idx, t_idx]
        self.logprobs[s_idx, at] = logprobs_bxN[s_idx, t_idx]
        # The first token of each slot came from the logits the last call (or the prefill) left.
        self.versions[s_idx, at] = np.where(t_idx == 0, self.logits_version[s_idx], version)
        self.logits_version[:b][sampled] = version
        self.length[:b] += n_b
        self.stats["tokens"] += int(n_b.sum())
        self.stats["decode_calls"] += 1
        ended = []
        for s in np.flatnonzero(sampled & ~live_b):
            ended.append(self._finish(int(s)))
        return ended

    def _finish(self, s: int) -> Row:
        row, n = self.rows[s], int(self.length[s])
        row.tokens = self.tokens[s, :n].tolist()
        row.logprobs = self.logprobs[s, :n].tolist()
        row.versions = self.versions[s, :n].tolist()
        row.finish_reason = "stop" if row.tokens[-1] in row.stop_ids else "length"
        keep = int(self.keep_row[s])  # scratch for a row that saw two versions (see schedule)
        # Its last token is not fed back: the cache holds the prompt and the tokens before it.
        sequence = None if keep == self.prefix.scratch else np.concatenate([self.prompt[s], self.tokens[s, :n - 1]])
        self.ended.append((s, keep, sequence, self.prompt_hashes[s]))
        self._free(s)
        return row

    def _free(self, s: int) -> None:
        self.rows[s], self.prompt[s], self.prompt_hashes[s] = None, None, []

    def _move(self, src: int, dst: int) -> None:
        self.rows[dst], self.prompt[dst], self.prompt_hashes[dst] = self.rows[src], self.prompt[src], self.prompt_hashes[src]
        for state in (self.keep_row, self.logits_version, self.prompt_version, self.length, self.tokens, self.logprobs,
                      self.versions):
            state[dst] = state[src]
        self._free(src)
