"""The compile-apart benchmark runs at tiny sizes and prints its figures as a JSON last line."""

import math

from benches import tiny_figures


def test_tiny_benchmark_times_the_three_processes():
    figures = tiny_figures("compile_apart", timeout=240, one_device=True)
    for part in ("here", "apart", "loaded"):
        for key in ("compile_s", "step_s", "max_rss_mb"):
            value = figures[f"{part}_{key}"]
            assert math.isfinite(value) and value > 0, (part, key, figures)
    assert figures["here_compiles"] >= 1  # the run's prompt widths
    assert figures["loaded_compiles"] == 0, figures  # all from the cache the apart process filled
    assert figures["here_over_apart_step"] > 0 and figures["apart_over_loaded_step"] > 0
