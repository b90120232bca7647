"""The JAX engine's host plan, without JAX: which slots a tick saves, moves and fills, what the prefix
pool reuses, and how a decode's output becomes rows' tokens, logprobs and versions."""

import subprocess
import sys

import numpy as np
import pytest

from bridge.engines.scheduler import MIN_BATCH, PrefixIndex, Row, Scheduler, prefill_order, prefill_steps


def output(plan, sampled: dict[int, list[int]], live: set[int], logp: float = -0.5):
    """A decode's output for the plan: slot -> tokens sampled (padded with -1), and the slots still live."""
    steps = max((len(t) for t in sampled.values()), default=1)
    tokens = np.full((plan.batch, steps), -1, np.int32)
    for s, t in sampled.items():
        tokens[s, :len(t)] = t
    return tokens, np.where(tokens >= 0, logp, 0.0).astype(np.float32), np.array([s in live for s in range(plan.batch)])


def test_the_module_imports_no_jax():
    code = "import sys, bridge.engines.scheduler; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_new_rows_take_the_first_slots_and_the_decode_batch_is_a_power_of_two():
    s = Scheduler(max_batch=8, max_seq_len=64, pool_rows=4)
    rows = [Row([1, 2, 3], 4, seed=i) for i in range(3)]
    s.add(rows)
    plan = s.schedule(version=0)
    assert plan.batch == 8 and plan.new == rows  # MIN_BATCH
    assert plan.slot.tolist() == [0, 1, 2] and plan.cached.tolist() == [0, 3, 3]
    assert plan.leader.tolist() == [0, 0, 0]  # one prompt: the first row prefills it for the others
    assert len(plan.save_slot) == len(plan.move_from) == 0 and s.rows[:3] == rows


def test_output_becomes_tokens_versions_and_ended_rows():
    s = Scheduler(max_batch=4, max_seq_len=64, pool_rows=4)
    stop, long = Row([1, 2], 8, seed=0, stop_ids=(9,)), Row([5, 6, 7], 5, seed=1)
    s.add([stop, long])
    plan = s.schedule(version=3)
    assert s.update_from_output(plan, *output(plan, {0: [4, 9], 1: [1, 2]}, live={1}), version=3) == [stop]
    assert stop.tokens == [4, 9] and stop.finish_reason == "stop" and stop.versions == [3, 3]
    assert stop.logprobs == [-0.5, -0.5] and long.tokens == []  # a row's lists are filled when it ends
    plan = s.schedule(version=4)  # new weights: the first token came from logits of version 3
    assert plan.save_slot.tolist() == [0] and plan.save_row.tolist() == [s.prefix.scratch]
    assert plan.move_from.tolist() == [] and plan.batch == 4  # MIN_BATCH past max_batch: nothing to move down
    assert s.update_from_output(plan, *output(plan, {1: [3, 3, 3]}, live=set()), version=4) == [long]
    assert long.tokens == [1, 2, 3, 3, 3] and long.versions == [3, 3, 3, 4, 4] and long.finish_reason == "length"


def test_live_rows_move_down_into_the_first_slots():
    s = Scheduler(max_batch=16, max_seq_len=64, pool_rows=0)
    rows = [Row([i + 1], 9, seed=i) for i in range(16)]
    s.add(rows)
    plan = s.schedule(0)
    assert plan.batch == 16
    s.update_from_output(plan, *output(plan, {i: [1] for i in range(16)}, live={12}), 0)
    plan = s.schedule(0)
    assert plan.batch == MIN_BATCH and plan.save_slot.tolist() == [i for i in range(16) if i != 12]
    assert (plan.move_from.tolist(), plan.move_to.tolist()) == ([12], [0]) and s.rows[0] is rows[12]
    s.update_from_output(plan, *output(plan, {0: [7, 8]}, live=set()), 0)
    assert rows[12].tokens == [1, 7, 8]  # the tokens moved with the row


def test_a_next_turn_reuses_its_episodes_pool_row_in_place():
    s = Scheduler(max_batch=2, max_seq_len=64, pool_rows=4, block=4)
    first = Row(list(range(10, 20)), 6, seed=0)
    s.add([first])
    plan = s.schedule(0)
    pool_row = int(s.keep_row[0])
    s.update_from_output(plan, *output(plan, {0: [1, 2, 3]}, live=set()), 0)
    turn = Row(first.prompt + first.tokens + [30, 31], 4, seed=1)
    s.add([turn])
    plan = s.schedule(0)
    assert plan.save_row.tolist() == [pool_row]  # the ended row's sequence goes to the row it claimed
    assert plan.src.tolist() == [pool_row] and plan.cached.tolist() == [12]  # its prompt and tokens but the last
    assert int(s.keep_row[0]) == pool_row  # and extends it in place
    assert s.prefix.stats == {"prompt_tokens": 10 + 15, "cached_tokens": 12}


def test_prefix_lookup_takes_the_longest_shared_prefix_past_whole_blocks():
    index = PrefixIndex(rows=3, block=4)
    seqs = [np.arange(10), np.r_[np.arange(6), 50, 51], np.arange(100, 120)]
    for row, seq in enumerate(seqs):
        index.keep(row, seq)
    for prompt, want in ((np.r_[np.arange(10), 7], (0, 10)), (np.r_[np.arange(7), 99], (0, 7)),
                         (np.r_[np.arange(6), 50, 51, 52], (1, 8)), (np.arange(3), (3, 0)),
                         (np.arange(100, 120), (2, 19))):  # never the whole prompt: its last token is prefilled
        assert index.lookup(prompt, index.block_hashes(prompt)) == want
    index.keep(0, None)  # overwritten: no longer found
    assert index.lookup(np.r_[np.arange(10), 7], index.block_hashes(np.r_[np.arange(10), 7])) == (1, 6)


def test_with_sliding_layers_a_row_longer_than_the_window_serves_only_prompts_continuing_it():
    """Sliding layers over 8 keys keep a sequence's last 8: a row of 16 serves its whole sequence (or all but
    its last token), not a prompt leaving it earlier, which a shorter row sharing fewer blocks then serves."""
    index, dense = PrefixIndex(rows=3, block=4, sliding_window=8), PrefixIndex(rows=3, block=4)
    for i in (index, dense):
        i.keep(0, np.r_[np.arange(12), 77, 78, 79, 80])
        i.keep(1, np.arange(9))
        i.keep(2, np.arange(100, 106))  # within the window: any prefix of it serves
    for prompt, want, want_dense in ((np.r_[np.arange(12), 77, 78, 79, 80, 5], (0, 16), (0, 16)),
                                     (np.r_[np.arange(12), 77, 78, 79, 80], (0, 15), (0, 15)),
                                     (np.r_[np.arange(12), 5], (1, 9), (0, 12)),
                                     (np.r_[np.arange(6), 99], (3, 0), (1, 6)),
                                     (np.r_[np.arange(100, 104), 1], (2, 4), (2, 4))):
        assert index.lookup(prompt, index.block_hashes(prompt)) == want
        assert dense.lookup(prompt, dense.block_hashes(prompt)) == want_dense


def test_claims_prefer_the_extended_row_then_empty_rows_then_the_least_recently_used():
    index = PrefixIndex(rows=3, block=4)
    index.keep(0, np.arange(8))
    assert index.claim(0) == 0
    assert index.claim(0) in (1, 2)  # taken: an empty row
    index.keep(1, np.arange(8, 16))
    index.keep(2, np.arange(16, 24))
    index.keep(0, np.arange(8))
    # Every row holds a sequence: the least recently claimed first (row 2 never was), none once all are claimed.
    assert [index.claim(index.scratch) for _ in range(4)] == [2, 0, 1, index.scratch]


def test_new_weights_forget_the_pool_and_rows_under_way_are_not_kept():
    s = Scheduler(max_batch=2, max_seq_len=64, pool_rows=2, block=2)
    row = Row([1, 2, 3, 4], 6, seed=0)
    s.add([row])
    plan = s.schedule(0)
    s.update_from_output(plan, *output(plan, {0: [5]}, live={0}), 0)
    plan = s.schedule(1)
    s.update_from_output(plan, *output(plan, {0: [6, 7]}, live=set()), 1)
    assert row.versions == [0, 0, 1]
    again = Row([1, 2, 3, 4, 5, 6, 8], 2, seed=1)
    s.add([again])
    plan = s.schedule(1)
    assert plan.save_row.tolist() == [s.prefix.scratch] and plan.cached.tolist() == [0]


def test_dropped_rows_free_their_slots_for_waiting_ones():
    s = Scheduler(max_batch=1, max_seq_len=64, pool_rows=0)
    gone, waiting = Row([1], 9, seed=0), Row([2], 9, seed=1)
    s.add([gone, waiting])
    plan = s.schedule(0)
    s.update_from_output(plan, *output(plan, {0: [3]}, live={0}), 0)
    s.drop([gone])
    plan = s.schedule(0)
    assert plan.save_slot.tolist() == [0] and plan.new == [waiting] and plan.slot.tolist() == [0]
    assert gone.finish_reason is None and not s.waiting


def test_rows_that_do_not_fit_are_refused():
    s = Scheduler(max_batch=1, max_seq_len=8, pool_rows=0)
    with pytest.raises(ValueError, match="within max_seq_len 8 tokens in all; got 6 \\+ 3"):
        s.add([Row([1] * 6, 3, seed=0)])


def test_prefill_order_puts_leaders_with_work_first_in_blocks():
    prompt_len = np.array([5, 5, 9, 3, 1, 1, 1, 1])
    cached = np.array([0, 5, 1, 3, 0, 0, 0, 0])
    leader = np.array([0, 0, 2, 3, 4, 5, 6, 7])
    order, chunk_I, chunks, tail_I, tails = prefill_order(prompt_len, cached, leader, real_rows=4, chunk=4, tail=1,
                                                          width=16)
    assert order.tolist() == [2, 0, 1, 3, 4, 5, 6, 7]  # the longest rest first; row 1 copies row 0, row 3 is all cached
    # Blocks of one row: rests of 8 (two chunks) and 5 (a chunk, then a tail).
    assert chunks == 3 and chunk_I[:3].tolist() == [0, 0, 1]
    assert tails == 1 and tail_I[:1].tolist() == [1]
    order, chunk_I, chunks, tail_I, tails = prefill_order(
        np.tile(prompt_len, 2), np.tile(cached, 2), np.r_[leader, leader + 8], real_rows=12, chunk=4, tail=2, width=16)
    assert order[:8].tolist() == [2, 10, 0, 8, 4, 5, 6, 7]  # padding (rows 12 on) prefills nothing
    # Blocks of two, rests (8, 8), (5, 5), (1, 1), (1, 1): each block as many steps as its longest rest.
    assert chunks == 2 and chunk_I[:2].tolist() == [0, 1]
    assert tails == 5 and tail_I[:5].tolist() == [0, 0, 1, 2, 3]
    assert len(chunk_I) == 8 * (16 // 4) and len(tail_I) == 8 * 2  # each of 8 blocks its most steps: fixed shapes


def test_a_rest_takes_chunks_while_more_than_two_tails_are_left_then_tails():
    chunks, tails = prefill_steps(np.array([300, 94, 192, 256, 20, 65, 64, 0]), chunk=128, tail=32)
    assert chunks.tolist() == [2, 1, 1, 2, 0, 1, 0, 0]
    assert tails.tolist() == [2, 0, 2, 0, 1, 0, 2, 0]
    chunks, tails = prefill_steps(np.array([5, 2, 1]), chunk=1, tail=1)  # a chunk no longer than the two tails
    assert chunks.tolist() == [3, 0, 0] and tails.tolist() == [2, 2, 1]


def test_a_tick_runs_a_power_of_two_of_rows_from_min_batch_up_to_max_batch():
    assert [Scheduler(64, 64, 0).batch(n) for n in (1, 8, 9, 17, 64)] == [MIN_BATCH, 8, 16, 32, 64]
    assert Scheduler(4, 64, 0).batch(1) == 4  # never past max_batch


def test_the_slots_in_use_are_the_longest_live_sequence():
    s = Scheduler(max_batch=8, max_seq_len=64, pool_rows=0)
    rows = [Row([1, 2, 3], 9, seed=0), Row([4, 5, 6, 7, 8], 9, seed=1)]
    s.add(rows)
    plan = s.schedule(0)
    assert s.in_use(range(plan.batch)) == 5 and s.in_use([0]) == 3 and s.in_use([]) == 0
    s.update_from_output(plan, *output(plan, {0: [1, 1, 1, 1], 1: [2]}, live={0, 1}), 0)
    assert s.in_use(range(plan.batch)) == 3 + 4  # prompt and tokens sampled


def test_a_decode_groups_rows_that_share_enough_of_their_prompts_for_their_own_slots():
    s = Scheduler(max_batch=16, max_seq_len=64, pool_rows=0, block=4)
    prompt = list(range(1, 13))  # 3 blocks
    s.add([Row(prompt, 9, seed=i) for i in range(6)] + [Row(prompt[:8] + [20 + i] * 4, 9, seed=6 + i) for i in range(4)])
    plan = s.schedule(0)
    groups = s.groups(plan.batch, steps=4, own=8, width=64)  # 8 slots: 2 blocks of prefix leave 4 + 4 steps
    assert groups.length.tolist() == [8, 8]  # the fewest blocks that do (all 10 rows share 2)
    assert sorted(groups.members[0].tolist()) == sorted(set(range(10)) - set(groups.members[1, :2].tolist()))
    assert groups.src.tolist() == groups.members[:, 0].tolist()
    assert np.bincount(groups.group[:10]).tolist() == [8, 2]  # n = 8 rows a group
    assert all(groups.members[g, r] == b for b, (g, r) in enumerate(zip(groups.group[:10], groups.rank[:10])))
    assert s.groups(plan.batch, steps=4, own=7, width=64) is None  # 3 blocks: 4 rows share them with none
    assert s.groups(plan.batch, steps=4, own=8, width=15) is None  # 8 of prefix and 8 own slots pass 15
    s.update_from_output(plan, *output(plan, {i: [1, 1] for i in range(10)}, live=set(range(10))), 0)
    assert s.groups(plan.batch, steps=4, own=8, width=64) is None  # and now 2 tokens sampled
    assert s.groups(plan.batch, steps=4, own=10, width=64).length.tolist() == [8, 8]
    assert s.stats["shared_decode_calls"] == 2


def test_rows_decode_apart_from_keys_of_other_weights_and_past_the_groups_a_batch_holds():
    prompt = list(range(1, 13))
    s = Scheduler(max_batch=16, max_seq_len=64, pool_rows=0, block=4)
    s.add([Row(prompt, 9, seed=i) for i in range(8)])
    plan = s.schedule(0)
    s.update_from_output(plan, *output(plan, {i: [1] for i in range(8)}, live=set(range(8))), 0)
    s.add([Row(prompt, 9, seed=8), Row(prompt, 9, seed=9)])
    plan = s.schedule(1)  # their prompt's keys are the new weights'
    groups = s.groups(plan.batch, steps=4, own=8, width=64)
    assert groups.group[:10].tolist() == [0] * 8 + [1] * 2 and groups.src.tolist() == [0, 8]
    s = Scheduler(max_batch=8, max_seq_len=64, pool_rows=0, block=4)  # 8 slots: one group
    s.add([Row(prompt, 9, seed=0), Row(prompt, 9, seed=1), Row(prompt[::-1], 9, seed=2), Row(prompt[::-1], 9, seed=3)])
    assert s.groups(s.schedule(0).batch, steps=4, own=8, width=64) is None
    s = Scheduler(max_batch=16, max_seq_len=64, pool_rows=0, block=4)
    s.add([Row(prompt, 9, seed=0), Row(prompt[::-1], 9, seed=1)])  # nothing shared: nothing to gain
    assert s.groups(s.schedule(0).batch, steps=4, own=8, width=64) is None
    assert s.groups(s.schedule(0).batch, steps=4, own=16, width=64) is None  # (no prefix needed at all)
