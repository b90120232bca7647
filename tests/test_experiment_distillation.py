"""The distillation experiment at toy size: a student of half the teacher's layers, distilled and not."""

import yaml

from examples import toy_result


def test_toy_distillation_trains_a_smaller_student_with_and_without_its_teacher(tmp_path):
    result = toy_result("distillation", tmp_path)
    assert set(result["variants"]) == {"grpo", "distill"}
    assert "| distill |" in (tmp_path / "distillation.md").read_text()
    ran = yaml.safe_load((tmp_path / "runs" / "distill" / "config.yaml").read_text())
    assert ran["learner"]["loss"]["distill_weight"] == 1.0 and ran["learner"]["loss"]["task_weight"] == 0.0
    assert ran["teacher"]["model"] == str(tmp_path / "teacher-model")
    student = yaml.safe_load((tmp_path / "student-start" / "config.json").read_text())
    teacher = yaml.safe_load((tmp_path / "teacher-model" / "config.json").read_text())
    assert student["num_hidden_layers"] == 1 and teacher["num_hidden_layers"] == 2
