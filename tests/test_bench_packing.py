"""The packing benchmark runs at tiny sizes: every side takes a step of the same batch, and its last
line is the JSON of their figures."""

import math

from benches import tiny_figures

SIDES = {"padded", "narrow", "packed", "apart", "torch"}


def test_tiny_benchmark_prints_every_sides_figures():
    figures = tiny_figures("packing", timeout=240, one_device=True)
    for key in ("real_tokens_per_s", "step_s", "computed_tokens"):
        assert set(figures[key]) == SIDES, (key, figures[key])
        assert all(math.isfinite(v) and v > 0 for v in figures[key].values()), (key, figures[key])
    # Every side trains on the same episodes: the same gradient, whatever the layout or the framework.
    assert figures["grad_norm_rel_diff"] < 1e-3, figures
    assert figures["real_tokens"] > 0 and figures["episodes"] == 16
    assert all(math.isfinite(v) and v > 0 for v in figures["ratios"].values()), figures["ratios"]
