"""The engines benchmark keeps working (tiny sizes; the figures themselves are not asserted)."""

from benches import tiny_figures


def test_tiny_engines_benchmark_prints_its_figures():
    figures = tiny_figures("engines", one_device=True)
    for key in ("jax_tok_s", "jax_bridge_tok_s", "bridge_over_inproc", "hf_generate_tok_s", "jax_over_floor"):
        assert figures[key] > 0, key
    assert figures["floor"]["tok_s"] > 0
    assert "vllm_cpu_tok_s" in figures
