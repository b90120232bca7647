"""The MoE benchmark runs at tiny sizes and prints its ratios and each side's work as a JSON last line."""

import math

from benches import tiny_figures

RATIOS = ("learner_over_torch", "grouped_over_dense", "grouped_over_ragged_dot", "moe_decode_over_dense",
          "route_recording_ratio")


def test_tiny_benchmark_prints_its_ratios_over_the_same_work():
    figures = tiny_figures("moe", timeout=600, one_device=True)
    assert list(figures)[:len(RATIOS)] == list(RATIOS)
    for key in RATIOS:
        assert math.isfinite(figures[key]) and figures[key] > 0, (key, figures[key])
    # Same weights, batch and loss in both frameworks: their first gradients agree.
    assert figures["learner"]["grad_norm_rel_diff"] < 1e-3
    assert figures["learner"]["torch_experts"] and figures["learner"]["flops_per_step"] > 0
    model = figures["model"]
    assert model["active_params"] < model["params"]
    # The dense twin has the MoE's active parameters, less its routers.
    routers = model["layers"] * model["hidden"] * model["experts"]
    assert model["dense_twin_params"] == model["active_params"] - routers
    experts = figures["experts"]
    assert experts["pairs"] == 2 * experts["tokens"] and experts["dense_flops"] > experts["grouped_flops"]
    decode = figures["decode"]
    assert decode["compiles_while_timed"] == 0
    # Every engine produced the same tokens; only the MoE engine with its route buffer recorded routes.
    assert decode["moe"]["tokens"] == decode["moe_without_routes"]["tokens"] == decode["dense"]["tokens"] > 0
    sequences = decode["moe"]["floor"]["rows"]
    assert (decode["moe"]["routed_completions"], decode["moe_without_routes"]["routed_completions"],
            decode["dense"]["routed_completions"]) == (sequences, 0, 0)
    assert figures["machine"]["matmul_gflop_s"] > 0
