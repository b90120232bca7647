"""The training config: shipped configs load, cross-field checks name the keys."""

from pathlib import Path

import pytest

from jaxrl.run.config import ConfigError, TrainConfig, load_config
from jaxrl.run.typed_config import dump_yaml, from_dict

ROOT = Path(__file__).resolve().parents[1]
BASE = {"run_dir": "r", "model": {"dir": "m"}, "envs": [{"name": "echo", "bundled": "echo"}]}


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.envs and cfg.steps >= 1


@pytest.mark.parametrize("extra, message", [
    ({"envs": []}, "list at least one environment"),
    ({"envs": [{"name": "a", "bundled": "echo"}, {"name": "a", "bundled": "wordle"}]}, "names must be unique"),
    ({"data": {"mix": {"chess": 1.0}}}, "data.mix names unknown environment"),
    ({"rewards": []}, "rewards: need at least one"),
    ({"rewards": [{"fn": "env"}, {"fn": "env"}]}, "distinct names"),
    ({"rewards": [{"model": "/no/such/rm", "kind": "classifier"}]},
     r"^config: rewards\[0\] \(classifier\): model '/no/such/rm' is not a model directory \(no config.json\); give "
     r"a Hugging Face directory of safetensors and its tokenizer$"),
    ({"rewards": [{"model": "m", "kind": "scorer"}]},
     r"^config key 'rewards.0.kind': expected one of 'classifier', 'judge' or null, got 'scorer'$"),
    ({"rewards": [{"model": "m"}]}, r"^config key 'rewards.0': reward 'reward_model': kind None is not one of "
                                    r"classifier, judge; a reward model needs one$"),
    ({"rewards": [{"kind": "judge", "judge": "policy"}]},
     r"^config key 'rewards.0': reward 'judge': a judge needs a template \(the rubric, with \{completion\} or "
     r"\{conversation\} where the trajectory goes\)$"),
    ({"rewards": [{"kind": "judge", "judge": "policy", "template": "Is {prompt} answered?"}]},
     r"template 'Is \{prompt\} answered\?' shows the judge no trajectory; put \{completion\} or "
     r"\{conversation\} in it"),
    ({"rewards": [{"kind": "judge", "judge": "policy", "template": "{completion", "name": "j"}]},
     r"^config key 'rewards.0': reward 'j': template '\{completion': .*; write fields as \{name\}"),
    ({"rewards": [{"kind": "judge", "judge": "policy", "template": "{completion}", "verdicts": {}}]},
     r"verdicts must map words to finite numbers, e.g. \{yes: 1, no: 0\}; got \{\}"),
    ({"rewards": [{"kind": "judge", "judge": "the policy", "template": "{completion}"}]},
     r"^config key 'rewards.0.judge': expected one of 'policy' or null, got 'the policy'$"),
    ({"rewards": [{"kind": "judge", "model": "m", "judge": "policy", "template": "{completion}"}]},
     r"reward 'judge': set exactly one of fn \(a function or 'env'\), model \(a reward model's directory, with "
     r"kind\) or judge: policy \(got model, judge\)"),
    ({"rewards": [{"fn": "env", "template": "{completion}"}]},
     r"reward 'env': a reward function \(fn\) takes no template \(reward models do\); leave them out"),
    ({"rewards": [{"model": "m", "kind": "classifier", "verdicts": {"yes": 1}}]},
     r"reward 'classifier': a classifier takes no verdicts \(judges do: kind: judge\)"),
    ({"rewards": [{"kind": "judge", "judge": "policy", "template": "{completion}", "max_tokens": 0}]},
     r"reward 'judge': max_tokens=0 must be >= 1"),
    ({"rollout": {"max_tokens": 64, "max_total_tokens": 32}}, "max_total_tokens >= max_tokens"),
    ({"rollout": {"mode": "async"}}, "learner.loss.is_level"),
    ({"rollout": {"max_prompt_tokens": 0}}, "rollout.max_prompt_tokens=0 must be >= 1"),
    ({"eval": {"pass_k": 4}}, "eval.temperature > 0"),
    ({"learner": {"group_size": 1}}, "learner.group_size=1 must be >= 2"),
    ({"rollout": {"groups_per_step": 3}, "learner": {"group_size": 2, "grad_accum": 4}}, "divisible"),
    ({"learner": {"pack_tokens": 512}, "rollout": {"max_prompt_tokens": 512, "max_total_tokens": 256}},
     r"learner.pack_tokens=512 is shorter than an episode may be \(rollout.max_prompt_tokens \+ max_total_tokens = "
     r"768\): raise it to at least that"),
    ({"learner": {"pack_tokens": 1000}}, r"learner.pack_tokens=1000 must be a multiple of 64 and at least 128"),
    ({"sft": {"envs": ["wordle"]}}, "sft.envs names unknown"),
    ({"envs": [{"name": "x", "url": "http://a", "env_class": "m:C"}]}, "exactly one of bundled, url, env_class"),
    ({"envs": [{"name": "e", "bundled": "echo", "max_retries": 2}]},
     "config key 'envs.0.max_retries' is gone: set 'envs.0.retry_budget_s' instead"),
    ({"bridge": {"request_timeout_s": 900}}, r"request_timeout_s=900 is shorter than an episode may take .*1920 s"),
    ({"bridge": {"per_host": 2, "devices": ["0,1"]}},
     r"^config key 'bridge': devices lists 1 device group\(s\) but per_host=2: give one per bridge, or none$"),
    ({"bridge": {"per_host": 0}}, r"^config key 'bridge': per_host=0 must be >= 1$"),
    ({"run_dir": "gs://bucket/run"}, r"run_dir='gs://bucket/run': a URL; .* mount the bucket"),
    ({"snapshot_dir": "http://host/snaps"}, r"snapshot_dir: http://host/snaps: snapshots go to a directory or to "
                                           r"a gs:// or s3:// bucket, not to a http:// URL"),
    ({"snapshot_dir": "s3://bucket/../x"}, r"snapshot_dir: s3://bucket/../x: give the bucket and a path in it"),
    ({"sft": {"steps": 5, "train_all": True}},
     r"^config: sft.train_all=true applies to LoRA runs: without learner.lora the warm start trains every weight "
     r"already; leave it out$"),
    ({"sft": {"train_all": False}, "learner": {"lora": {}}},
     r"^config: sft.train_all=false with sft.steps=0: there is no warm start to train; set sft.steps, or leave "
     r"sft.train_all out$"),
    ({"model": {"dir": "m", "tiny": {}}, "sft": {"steps": 5}, "learner": {"lora": {}},
      "bridge": {"addresses": ["127.0.0.1:9"]}},
     r"^config: sft.train_all \(true for a model.tiny model\) restarts the bridges on the warm-started model, "
     r"which bridge.addresses cannot: leave them empty, or set sft.train_all: false$"),
])
def test_cross_field_errors(extra, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(TrainConfig, {**BASE, **extra})


def test_snapshots_may_go_to_a_bucket():
    assert from_dict(TrainConfig, {**BASE, "snapshot_dir": "gs://bucket/snaps"}).snapshot_dir == "gs://bucket/snaps"


def test_the_learner_config_takes_the_values_the_run_derives(tmp_path):
    cfg = from_dict(TrainConfig, {**BASE, "steps": 30, "rollout": {"temperature": 0.7},
                                  "rewards": [{"fn": "env"}, {"fn": "m:f", "weight": 0.5}],
                                  "learner": {"num_iterations": 2, "optimizer": {"schedule": "cosine"}}})
    lc = cfg.learner_config()
    assert lc.temperature == 0.7 and lc.advantages.reward_weights == (1.0, 0.5) and lc.optimizer.total_steps == 60
    assert lc.optimizer.schedule == "cosine"
    # derived keys are not user keys: refused in a file, left out of the saved config, which loads back
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_dir: r\nmodel: {dir: m}\nenvs: [{name: echo, bundled: echo}]\n"
                   "learner: {optimizer: {total_steps: 5}}\n")
    with pytest.raises(ConfigError, match=r"'learner.optimizer.total_steps' is not a config key: the run derives it "
                                          r"from steps x learner.num_iterations; set that instead"):
        load_config(bad)
    saved = dump_yaml(cfg, tmp_path / "saved.yaml")
    assert "total_steps" not in saved.read_text() and load_config(saved) == cfg


def test_rollout_requests_outlast_their_episodes_replays():
    assert from_dict(TrainConfig, BASE).rollout_timeout_s == 2 * 900 + 120 + 60
    unbounded = {**BASE, "envs": [{"name": "echo", "bundled": "echo", "episode_timeout_s": None}]}
    assert from_dict(TrainConfig, unbounded).rollout_timeout_s is None
    assert from_dict(TrainConfig, {**BASE, "bridge": {"request_timeout_s": 3000}}).rollout_timeout_s == 3000


def test_warm_start_needs_environments_with_solvers():
    with pytest.raises(ConfigError, match="sft.envs names environment"):
        from_dict(TrainConfig, {**BASE, "envs": [{"name": "u", "url": "http://127.0.0.1:1"}],
                                "sft": {"steps": 5, "envs": ["u"]}})
    served = from_dict(TrainConfig, {**BASE, "sft": {"steps": 5}})
    assert served.envs[0].solver == "echo"  # a bundled environment's own


@pytest.mark.parametrize("tiny, train_all, lora, steps, full", [
    ({}, None, {}, 5, True),  # a random model: nothing for adapters to adapt
    (None, None, {}, 5, False),  # a pretrained one: the warm start trains the adapters
    (None, True, {}, 5, True),
    ({}, False, {}, 5, False),
    ({}, None, None, 5, False),  # no adapters: every weight trains anyway
    ({}, None, {}, 0, False),  # no warm start
])
def test_a_lora_warm_start_trains_every_weight_of_a_tiny_model_unless_told(tiny, train_all, lora, steps, full):
    cfg = from_dict(TrainConfig, {**BASE, "model": {"dir": "m", "tiny": tiny},
                                  "sft": {"steps": steps, **({} if train_all is None else {"train_all": train_all})},
                                  "learner": {"lora": lora}})
    assert cfg.full_warm_start is full
