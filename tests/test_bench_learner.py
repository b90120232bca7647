"""The learner benchmark runs at tiny sizes and prints its figures as a JSON last line."""

import math

from benches import tiny_figures

KEYS = ("train_tokens_per_s", "ratio_vs_torch", "peak_mem_mb", "logp_peak_mem_chunked_mb",
        "logp_peak_mem_unchunked_mb", "logp_mem_ratio_unchunked_vs_chunked", "max_rss_mb")


def test_tiny_benchmark_prints_figures():
    figures = tiny_figures("learner", timeout=120, one_device=True)
    for key in KEYS:
        value = figures[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, figures)
    assert figures["logp_peak_mem_chunked_mb"] < figures["logp_peak_mem_unchunked_mb"]
    # Same weights and loss in both frameworks: their first gradients agree.
    assert figures["grad_norm_rel_diff"] < 1e-3
    assert isinstance(figures["cpu"], str) and figures["cpu"]  # the ratio depends on it
    assert figures["cpu_vector_units"]
