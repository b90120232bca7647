"""The offline-learner example at toy size: episodes collected once through a bridge and saved, then
two learners trained on the saved file alone, compared."""

from examples import toy_result


def test_toy_offline_learner_trains_on_saved_trajectories(tmp_path):
    result = toy_result("offline_learner", tmp_path)
    assert result["groups"] == 4 and result["updates"] == 2
    assert set(result["final"]) == {"grpo", "dr_grpo+seq_is"}
    assert all(v["loss"] == v["loss"] for v in result["final"].values())  # finite: NaN != NaN
    assert (tmp_path / "trajectories.jsonl").read_text().count("\n") == 16
