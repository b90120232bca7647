"""The pod benchmark runs at tiny sizes (1 process x 8 devices, then 2 x 4) and prints its figures."""

import math

from benches import tiny_figures


def test_tiny_benchmark_prints_what_multi_host_adds_to_a_step():
    figures = tiny_figures("pod", timeout=300)
    for key in ("added_fraction", "share_fraction_multi", "share_ms_one", "share_ms_multi", "update_ms_one",
                "update_ms_multi"):
        assert isinstance(figures[key], float) and math.isfinite(figures[key]), (key, figures)
    assert figures["processes"] == 2 and figures["steps_measured"] == 3
    assert 0 < figures["share_fraction_multi"] < 1 and figures["update_ms_one"] > 0
