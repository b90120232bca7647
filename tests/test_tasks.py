"""Tasks by (step, slot): deterministic (resume draws the same), mixed by weight, held out apart."""

import json

import pytest

from jaxrl.run.config import TrainConfig
from jaxrl.run.tasks import EVAL_SEED_OFFSET, TaskError, TaskSource
from jaxrl.run.typed_config import from_dict


def config(**extra) -> TrainConfig:
    base = {"run_dir": "r", "model": {"dir": "m"},
            "envs": [{"name": "echo", "bundled": "echo"}, {"name": "rev", "url": "http://127.0.0.1:1"}]}
    return from_dict(TrainConfig, {**base, **extra})


def test_training_tasks_are_a_function_of_step_and_slot():
    a, b = TaskSource(config()), TaskSource(config())
    assert [a.train(7, s) for s in range(8)] == [b.train(7, s) for s in range(8)]
    assert a.train(7, 0) != a.train(8, 0)
    env, fields = next(t for t in (a.train(0, s) for s in range(20)) if t[0] == "echo")
    assert fields["split"] == "train" and isinstance(fields["seed"], int)
    env, fields = next(t for t in (a.train(0, s) for s in range(20)) if t[0] == "rev")
    assert "split" not in fields  # only bundled environments know splits


def test_mix_weights_and_task_fields():
    source = TaskSource(config(data={"mix": {"echo": 3.0, "rev": 1.0}, "task_fields": {"echo": {"max_steps": 2}}}))
    drawn = [source.train(s, 0) for s in range(2000)]
    share = sum(env == "echo" for env, _ in drawn) / len(drawn)
    assert 0.7 < share < 0.8
    assert all(f["max_steps"] == 2 for env, f in drawn if env == "echo")
    only = TaskSource(config(data={"mix": {"rev": 1.0}}))
    assert {only.train(s, 0)[0] for s in range(50)} == {"rev"}


def test_held_out_tasks_never_overlap_training_seeds():
    source = TaskSource(config(eval={"episodes": 10}))
    held = source.held_out()
    assert len(held) == 10 and {e for e, _ in held} == {"echo", "rev"}
    assert all(f["split"] == "test" for e, f in held if e == "echo")
    assert all(f["seed"] >= EVAL_SEED_OFFSET for e, f in held if e == "rev")
    assert [f for e, f in source.held_out("echo", 3)] == [{"seed": i, "split": "test"} for i in range(3)]


def test_task_files(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps({"env": "rev", "word": w}) for w in ("a", "b", "c")) + "\n")
    source = TaskSource(config(data={"train_file": str(train), "eval_file": str(train)},
                               rollout={"groups_per_step": 2}))
    epoch = [source.train(0, 0), source.train(0, 1), source.train(1, 0)]
    assert sorted(f["word"] for _, f in epoch) == ["a", "b", "c"]  # each row once per epoch
    assert source.held_out(n=2) == [("rev", {"word": "a"}), ("rev", {"word": "b"})]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"env": "rev"}\n{"env": "chess"}\n')
    with pytest.raises(TaskError, match="bad.jsonl line 2.*chess"):
        TaskSource(config(data={"train_file": str(bad)}))
    bad.write_text("{not json\n")
    with pytest.raises(TaskError, match="line 1: not JSON"):
        TaskSource(config(data={"train_file": str(bad)}))
    with pytest.raises(TaskError, match="no-such.jsonl"):
        TaskSource(config(data={"train_file": str(tmp_path / "no-such.jsonl")}))


def test_trl_dataset_rows(tmp_path):
    """A TRL dataset's rows as they are: prompt (chat messages or a string) plus columns, no env."""
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Guess: "}],
             "secret": 3},
            {"prompt": "Guess: ", "secret": 5}]
    train = tmp_path / "trl.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    one = {"envs": [{"name": "guess", "env_class": "m:Guess"}]}
    source = TaskSource(config(**one, data={"train_file": str(train), "eval_file": str(train)}))
    assert source.held_out() == [("guess", rows[0]), ("guess", rows[1])]  # every column kept, prompt included
    routed = tmp_path / "routed.jsonl"
    routed.write_text(json.dumps({"prompt": "p", "environment": "rev"}) + "\n")
    assert TaskSource(config(data={"eval_file": str(routed)})).held_out() == [("rev", {"prompt": "p"})]
    with pytest.raises(TaskError, match='trl.jsonl line 1: needs "env" \\(or TRL\'s "environment"\\) naming one '
                                        "of \\['echo', 'rev'\\], got None"):
        TaskSource(config(data={"train_file": str(train)}))  # two environments: a row must say which
    train.write_text(json.dumps({"prompt": [{"content": "no role"}]}) + "\n")
    with pytest.raises(TaskError, match="trl.jsonl line 1: task field 'prompt' must be a string or a non-empty list "
                                        "of chat messages"):
        TaskSource(config(**one, data={"train_file": str(train)}))


def test_an_env_class_is_reset_once_on_a_training_and_a_held_out_task_before_the_run_starts(tmp_path):
    from jaxrl.run.services import StartupError
    from jaxrl.run.tasks import checked_tasks

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "Say it.", "target": "hi"}) + "\n")
    trl = {"envs": [{"name": "target", "env_class": "tests.workers.trl_env:Target"}],
           "data": {"train_file": str(rows)}}
    with pytest.raises(StartupError) as e:
        checked_tasks(config(**trl))
    assert str(e.value) == ("environment 'target' cannot take its held-out task {'seed': 1000000}: TypeError: "
                            "Target.reset() missing 1 required positional argument: 'target'; give data.eval_file "
                            "rows it can take, or set eval.episodes: 0")
    assert checked_tasks(config(**trl, eval={"episodes": 0})).train_rows  # no evaluation: nothing held out
    tasks = checked_tasks(config(**{**trl, "data": {"train_file": str(rows), "eval_file": str(rows)}}))
    assert tasks.held_out("target", 1) == [("target", {"prompt": "Say it.", "target": "hi"})]
    with pytest.raises(StartupError, match="cannot take its first training task {'seed': 0}: TypeError"):
        checked_tasks(config(**{**trl, "data": {"eval_file": str(rows)}}))  # seed-drawn training tasks
    unset = config(envs=[{"name": "echo", "env_class": "bridge.envs.bundled.echo:EchoEnvironment"}])
    with pytest.raises(StartupError) as e:  # the environment itself cannot start: no task is blamed
        checked_tasks(unset)
    assert str(e.value).endswith("annotate `def step(self, action: MyAction)` or set action_class: 'module:MyAction'")


def test_an_environment_with_task_splits_trains_on_one_by_index_and_evaluates_on_the_other():
    quiz = {"name": "quiz", "env_class": "tests.workers.openenv_catalogue:QuizEnvironment"}
    cfg = config(envs=[quiz], data={"splits": {"quiz": {"train": "train", "eval": "test"}}}, eval={"episodes": 3})
    source = TaskSource(cfg)
    drawn = [source.train(s, 0) for s in range(40)]
    assert {env for env, _ in drawn} == {"quiz"} and all(set(f) == {"split", "index"} for _, f in drawn)
    assert {f["index"] for _, f in drawn} == {0, 1, 2} and {f["split"] for _, f in drawn} == {"train"}
    assert source.held_out() == [("quiz", {"split": "test", "index": i}) for i in (0, 1, 0)]
    with pytest.raises(TaskError, match=r"data.splits.quiz.eval: 'dev' is not a split of tasks of environment 'quiz'; "
                                        r"its splits: train \(3 tasks\), test \(2 tasks\)"):
        TaskSource(config(envs=[quiz], data={"splits": {"quiz": {"train": "train", "eval": "dev"}}}))
    with pytest.raises(ValueError, match=r"data.splits.quiz must be \{train: SPLIT, eval: SPLIT\}"):
        config(envs=[quiz], data={"splits": {"quiz": {"train": "train"}}})
    with pytest.raises(TaskError, match="data.splits.echo: environment 'echo': only url and env_class"):
        TaskSource(config(data={"splits": {"echo": {"train": "train", "eval": "test"}}}))
