"""What `jaxrl train` starts its bridge with."""

from jaxrl.run.config import TrainConfig
from jaxrl.run.services import engine_kwargs
from jaxrl.run.typed_config import from_dict

BASE = {"run_dir": "r", "model": {"dir": "m"}, "envs": [{"name": "echo", "bundled": "echo"}]}


def test_a_started_jax_engine_holds_the_rollouts_sequences_and_compiles_before_serving():
    cfg = from_dict(TrainConfig, {**BASE, "rollout": {"max_prompt_tokens": 300, "max_total_tokens": 200,
                                                      "max_tokens": 50}})
    assert engine_kwargs(cfg) == {"max_seq_len": 500, "warm_up": True}
    own = from_dict(TrainConfig, {**BASE, "bridge": {"engine_kwargs": {"max_seq_len": 4096, "prefill_chunk": 128}}})
    assert engine_kwargs(own) == {"max_seq_len": 4096, "prefill_chunk": 128, "warm_up": True}
    vllm = from_dict(TrainConfig, {**BASE, "bridge": {"engine": "vllm", "engine_kwargs": {"gpu_memory_utilization": 0.5}}})
    assert engine_kwargs(vllm) == {"gpu_memory_utilization": 0.5}
