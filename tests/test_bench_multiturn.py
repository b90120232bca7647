"""The multi-turn engine benchmark keeps working (tiny sizes; the figures themselves are not asserted)."""

from benches import tiny_figures


def test_tiny_multiturn_benchmark_prints_its_figures():
    figures = tiny_figures("multiturn", one_device=True)
    assert set(figures["ratios"]) == {"jax_over_ceiling", "continuous_over_batch_sync", "jax_over_hf_turn_sync",
                                      "jax_over_hf_sequential", "ceiling_over_floor", "jax_over_floor"}
    assert all(r > 0 for r in figures["ratios"].values())
    floor = figures["floor"]  # the machine's limit for a decode step, measured in the same run
    assert floor["tok_s"] > 0 and floor["bandwidth_gb_s"] > 0 and floor["matmul_gflop_s"] > 0
    assert figures["ceiling"]["tokens"] == figures["generated_tokens"] and figures["ceiling"]["compiles"] == 0
    for side in ("jax", "jax_batch_sync", "hf_turn_sync", "hf_sequential"):
        f = figures[side]
        assert f["tokens"] == figures["generated_tokens"] > 0, side  # every side generates the same tokens
        assert f["turns"] == figures["turns"], side
        assert f["wall_s"] > 0 and f["tok_s"] > 0 and f["turn_latency_median_ms"] > 0, side
    for side in ("jax", "jax_batch_sync"):
        assert figures[side]["decode_calls"] >= 1 and figures[side]["rows"] == figures["turns"]
        assert figures[side]["compiles"] == 0  # the warm-up compiled every batch size
        assert 0 < figures[side]["prompt_tokens_from_prefix_cache"] < 1  # later turns reuse earlier ones
    # A call of the batch-synchronous engine runs until its rows end: fewer, longer calls.
    assert figures["jax_batch_sync"]["decode_calls"] < figures["jax"]["decode_calls"]
    assert figures["hf_turn_sync"]["generate_calls"] >= 2  # every episode has at least two turns


def test_tiny_long_tail_mix_of_groups_runs():
    figures = tiny_figures("multiturn", "--mix", "long-tail", "--group-size", "2", "--skip-hf", one_device=True)
    assert set(figures["ratios"]) == {"jax_over_ceiling", "continuous_over_batch_sync", "ceiling_over_floor",
                                      "jax_over_floor"}
    assert figures["mix"] == "long-tail" and figures["jax"]["tokens"] == figures["generated_tokens"]
    floor = figures["floor"]  # a group's prompt is read once for the group
    assert floor["group"] == 2 and 0 < floor["shared"] < floor["context"]
    assert 0 <= figures["jax"]["shared_decode_calls"] <= figures["jax"]["decode_calls"]
