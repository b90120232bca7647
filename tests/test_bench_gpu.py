"""The GPU benchmark at toy sizes on the CPU: every part runs and the goals are computed, so the
module a lent GPU machine runs is known to work before its 15 minutes start."""

import io
import json
import math
import sys

import pytest

from benches import ROOT, tiny_figures

sys.path.insert(0, str(ROOT))
from experiments.bench import gpu  # noqa: E402

# learner_long, torch_learner_long, lora and multiturn are learner, torch_learner and the lora and
# multiturn benches (tested on their own) at other sizes: left out to keep CI short.
PARTS = ("peaks", "learner", "torch_learner", "engine", "hf_generate", "sync", "run", "moe_learner",
         "torch_moe_learner", "moe_engine")


# A GPU's time caps (gpu.BUDGETS) are minutes too few for toy sizes on a busy 2-core machine: the run part
# was stopped before its 2 steps there. The caps are what `--cap` is for; the figures stay the same.
CAPS = [arg for part in PARTS for arg in ("--cap", f"{part}=400")]


@pytest.mark.timeout(1000)  # ~100 s on a quiet machine, 230 s beside another test process
def test_tiny_run_measures_every_part_and_judges_the_goals(tmp_path):
    figures = tiny_figures("gpu", "--only", ",".join(PARTS), "--out", str(tmp_path), "--budget-s", "950", *CAPS,
                           timeout=990)
    for part in PARTS:
        assert "error" not in figures[part] and "skipped" not in figures[part], (part, figures[part])
    assert set(figures["goals"]) == {"learner_mfu", "learner_over_torch", "engine_over_floor", "engine_over_hf",
                                     "sync_0.6b_s", "run_finishes", "moe_learner_mfu", "moe_learner_over_torch",
                                     "moe_route_recording_ratio"}
    assert figures["goals"]["run_finishes"] == {"figure": 2, "met": True}
    for key, value in figures["derived"].items():
        assert math.isfinite(value) and value > 0, (key, value)
    # The engine samples what the learner scores: the same logprobs within bfloat16 rounding.
    assert figures["engine"]["agreement"]["learner_bfloat16"]["max"] < 0.05, figures["engine"]["agreement"]
    assert {"tiny_disk", "tiny_shm"} <= set(figures["sync"])
    assert figures["run"]["exit"] == 0 and figures["run"]["learn_s_median"] > 0
    assert {"moe_grouped_over_dense", "moe_engine_over_floor"} <= set(figures["derived"])
    assert figures["torch_moe_learner"]["bfloat16"]["model"] == "Qwen3MoeForCausalLM"
    assert figures["moe_learner"]["active_params"] < figures["moe_learner"]["params"]
    assert json.loads((tmp_path / "gpu.json").read_text())["goals"] == figures["goals"]
    assert "==== run" in (tmp_path / "gpu.log").read_text()


def test_a_failing_part_records_its_error_and_the_figures_it_had(tmp_path):
    result = gpu.run_part("no_such_part", tiny=True, work=tmp_path, timeout=120, log=io.StringIO())
    assert "part_no_such_part" in result["error"], result


def test_goals_come_from_the_parts_figures():
    results = {
        "peaks": {"matmul_flops": 1e15, "copy_bytes_per_s": 4e12},
        "learner": {"params": 6e8, "rows": 64, "tokens": 65536, "tokens_per_s": 1e5, "step_s": 0.65},
        "torch_learner": {"step_s": 1.3},
        "run": {"exit": 1, "steps": None},
        "moe_learner": {"active_params": 4e8, "params": 1.9e9, "tokens_per_s": 2e5, "step_s": 0.2,
                        "experts": {"dense_s": 0.8, "grouped_s": 0.1}},
        "torch_moe_learner": {"step_s": 0.5},
        "moe_engine": {"kv_bytes_per_token": 65536, "slots": 64, "prompt": 512, "new": 256, "params": 1.9e9,
                       "active_params": 4e8,
                       "decode": {"moe": {"decode_s_by_round": [1.1, 1.2, 1.0], "tokens": 16384, "tok_s": 4096},
                                  "moe_without_routes": {"decode_s_by_round": [1.0, 1.1, 1.0]}}},
    }
    out = gpu.derived(results)
    assert math.isclose(out["derived"]["learner_64x1024_mfu"], 6 * 6e8 * 1e5 / 1e15)
    assert out["goals"]["learner_mfu"]["met"] is True
    assert out["goals"]["learner_over_torch"] == {"figure": 2.0, "goal": ">= 1.5", "met": True}
    assert out["goals"]["run_finishes"]["met"] is False
    # An MoE's MFU counts its active parameters.
    assert math.isclose(out["derived"]["moe_learner_mfu"], 6 * 4e8 * 2e5 / 1e15)
    assert out["derived"]["moe_grouped_over_dense"] == 8.0
    floor = gpu.decode_floor_s(65536, 64, 512, 256, 4e12, 1e15, 1.9e9, 4e8)
    assert math.isclose(out["derived"]["moe_engine_over_floor"], 4.0 / floor)
    assert out["goals"]["moe_learner_over_torch"] == {"figure": 2.5, "goal": ">= 1.5", "met": True}
    assert out["goals"]["moe_route_recording_ratio"] == {"figure": 1.2 / 1.1, "goal": "<= 1.05", "met": False}
