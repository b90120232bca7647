"""Exporting a run's snapshots and train checkpoints as Hugging Face model directories."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors import safe_open

from jaxrl.checkpoints import TrainCheckpointer
from jaxrl.run.export import ExportError, ExportWarning, export
from jaxrl.learner import Learner
from jaxrl.models import Decoder
from jaxrl.run.run_dir import RunDir
from jaxrl.sharding import MeshConfig, make_mesh
from jaxrl.snapshots import SnapshotWriter
from jaxrl.tiny import tiny_config
from jaxrl.tiny_tokenizer import build_tokenizer
from jaxrl.train_step import LearnerConfig
from processes import error_line

IDS = np.array([[3, 17, 250, 9, 101, 42, 7, 300]])
SNAPSHOT_SEEDS = {3: 1, 5: 2}  # version -> model seed
CHECKPOINT_SEED, CHECKPOINT_STEP = 3, 7


def _model(cfg, seed):
    return Decoder(cfg, nnx.Rngs(seed))


def _logits(model):
    T = IDS.shape[1]
    logits, _ = model(IDS, np.arange(T)[None], np.ones((1, T), np.int32))
    return np.asarray(logits, np.float32)


def _hf_logits(path, **kw):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, **kw)
    with torch.no_grad():
        return hf(torch.tensor(IDS)).logits.float().numpy(), hf


def _write_run(path, family, snapshots=True, checkpoint=True, tokenizer=True, meta_config=True,
               tied=False):
    """A run directory like a training run leaves it; returns (run, cfg)."""
    run = RunDir.create(path)
    tok = build_tokenizer(run.tokenizer if tokenizer else None)
    cfg = tiny_config(family, tied=tied, vocab_size=len(tok),
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if snapshots:
        writer = SnapshotWriter(run.snapshots, cfg)
        for version, seed in SNAPSHOT_SEEDS.items():
            writer.publish(nnx.state(_model(cfg, seed), nnx.Param), version)
        writer.close()
    if checkpoint:
        # The params are sharded over the 8 test devices, as in a real run.
        learner = Learner(_model(cfg, CHECKPOINT_SEED), LearnerConfig(), make_mesh(MeshConfig()))
        meta = {"step": CHECKPOINT_STEP, "data_position": 0, "snapshot_version": 5}
        if meta_config:
            meta["model_config"] = cfg.to_hf()
        ckpt = TrainCheckpointer(run.checkpoints)
        ckpt.save(CHECKPOINT_STEP, learner.state, meta, force=True)
        ckpt.wait()
        ckpt.close()
    return run, cfg


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen3_moe", "gpt_oss"])
def run(request, tmp_path_factory):
    return _write_run(tmp_path_factory.mktemp(request.param) / "run", request.param)


def test_exports_load_in_transformers_with_the_same_logits(run, tmp_path):
    run, cfg = run
    cases = [
        ({}, _model(cfg, SNAPSHOT_SEEDS[5])),  # default: the newest snapshot
        ({"version": 3}, _model(cfg, SNAPSHOT_SEEDS[3])),
        ({"checkpoint_step": CHECKPOINT_STEP}, _model(cfg, CHECKPOINT_SEED)),
    ]
    for i, (kwargs, expected) in enumerate(cases):
        out = export(run.path, tmp_path / f"out{i}", **kwargs)
        assert out == tmp_path / f"out{i}"
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == cfg.model_type and config["dtype"] == "float32"
        ours = _logits(expected)
        theirs, hf = _hf_logits(out)
        assert hf.config.architectures == config["architectures"]
        mode = (out / "config.json").stat().st_mode
        assert (out / "model.safetensors").stat().st_mode == mode  # readable like config.json
        np.testing.assert_allclose(theirs, ours, atol=1e-4, err_msg=str(kwargs))

    tok = transformers.AutoTokenizer.from_pretrained(out)
    original = build_tokenizer()
    messages = [{"role": "user", "content": "Guess my number."}]
    assert tok.eos_token == original.eos_token and tok.chat_template == original.chat_template
    assert (tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
            == original.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    assert not list(tmp_path.glob(".*"))  # no temporary directory left behind


def test_snapshots_and_checkpoints_directories_and_single_steps(run, tmp_path):
    run, cfg = run
    ours = _logits(_model(cfg, CHECKPOINT_SEED))
    for i, source in enumerate([run.checkpoints, run.checkpoints / str(CHECKPOINT_STEP)]):
        theirs, _ = _hf_logits(export(source, tmp_path / f"c{i}"))
        np.testing.assert_allclose(theirs, ours, atol=1e-4)
        assert (tmp_path / f"c{i}" / "tokenizer.json").is_file()  # found through the run
    ours = _logits(_model(cfg, SNAPSHOT_SEEDS[3]))
    for i, (source, kw) in enumerate([(run.snapshots, {"version": 3}), (run.snapshots / "3", {})]):
        theirs, _ = _hf_logits(export(source, tmp_path / f"s{i}", **kw))
        np.testing.assert_allclose(theirs, ours, atol=1e-4)


def test_dtype_is_kept_or_converted(run, tmp_path):
    run, cfg = run
    model = _model(cfg, CHECKPOINT_SEED)
    out = export(run.path, tmp_path / "bf16", checkpoint_step=CHECKPOINT_STEP, dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
        assert embed.dtype == torch.bfloat16
        want = np.asarray(model.embed_tokens[...]).astype(jax.numpy.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(embed.float().numpy(), want)
    _, hf = _hf_logits(out)
    assert hf.dtype == torch.bfloat16

    # A bfloat16 serving snapshot stays bfloat16 without being asked.
    writer = SnapshotWriter(tmp_path / "bf16_snapshots", cfg, dtype="bfloat16")
    writer.publish(nnx.state(model, nnx.Param), 1)
    writer.close()
    with pytest.warns(ExportWarning, match="no tokenizer"):
        out = export(tmp_path / "bf16_snapshots", tmp_path / "bf16_snap")
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16


def test_run_without_snapshots_uses_its_newest_checkpoint(tmp_path):
    # Tied embeddings and qkv biases: the checkpoint has no lm_head, and has bias params.
    run, cfg = _write_run(tmp_path / "run", "qwen2", snapshots=False, tied=True)
    out = export(run.path, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    theirs, _ = _hf_logits(out)
    np.testing.assert_allclose(theirs, _logits(_model(cfg, CHECKPOINT_SEED)), atol=1e-4)


def test_cli_exports_and_reports_errors_in_one_line(run, tmp_path):
    run, cfg = run
    out = tmp_path / "cli_out"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl.run.cli", "export", str(run.path), "--checkpoint-step",
         str(CHECKPOINT_STEP), "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    theirs, _ = _hf_logits(out)
    np.testing.assert_allclose(theirs, _logits(_model(cfg, CHECKPOINT_SEED)), atol=1e-4)
    transformers.AutoTokenizer.from_pretrained(out)

    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl.run.cli", "export", str(run.path), "--version", "4", "--out",
         str(tmp_path / "bad")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    line = error_line(proc.stderr, "jaxrl export")
    assert "snapshot version 4" in line and "[3, 5]" in line
    assert not (tmp_path / "bad").exists()


def test_bad_sources_are_clear_errors(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="does not exist"):
        export(tmp_path / "missing", out)

    stray = tmp_path / "stray"
    (stray / "1").mkdir(parents=True)
    (stray / "notes.txt").write_text("hi")
    with pytest.raises(ExportError, match="neither a run directory"):
        export(stray, out)

    empty = RunDir.create(tmp_path / "empty")
    with pytest.raises(ExportError, match="no finished weight snapshot .* no finished train checkpoint"):
        export(empty.path, out)
    with pytest.raises(ExportError, match="no finished snapshot to export"):
        export(empty.snapshots, out)

    run, _ = _write_run(tmp_path / "run", "qwen3", tokenizer=False, meta_config=False)
    with pytest.raises(ExportError, match=r"no finished snapshot version 9; available: \[3, 5\]"):
        export(run.path, out, version=9)
    with pytest.raises(ExportError, match=r"no finished checkpoint step 8; available: \[7\]"):
        export(run.path, out, checkpoint_step=8)
    with pytest.raises(ExportError, match="has no 'model_config'"):
        export(run.path, out, checkpoint_step=CHECKPOINT_STEP)
    with pytest.raises(ExportError, match="not a checkpoint step"):
        export(run.snapshots, out, checkpoint_step=CHECKPOINT_STEP)
    with pytest.raises(ExportError, match="not both"):
        export(run.path, out, version=3, checkpoint_step=CHECKPOINT_STEP)
    assert not out.exists()

    with pytest.warns(ExportWarning, match="no tokenizer files"):
        export(run.path, out)
    assert (out / "config.json").is_file() and not (out / "tokenizer.json").exists()
    with pytest.raises(ExportError, match="not empty"):
        export(run.path, out)


def _lora_run(path, family="qwen3"):
    """A LoRA run's directory: its base model, a checkpoint of trained adapters, and their snapshot.
    Returns (run, base model directory, the learner's LoRA model)."""
    from jaxrl.models import save_pretrained
    from jaxrl.models.lora import LoraConfig, adapter_config
    from jaxrl.optim import OptimizerConfig

    from batches import make_batch

    run = RunDir.create(path / "run")
    tok = build_tokenizer(run.tokenizer)
    cfg = tiny_config(family, tied=False, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    base = path / "base"
    save_pretrained(_model(cfg, 4), base)
    targets = ("q_proj", "k_proj", "o_proj") + (("gate_proj", "down_proj") if family != "qwen3_moe" else ())
    lora = LoraConfig(rank=4, alpha=8.0, targets=targets)
    learner = Learner(_model(cfg, 4), LearnerConfig(group_size=4, lora=lora,
                                                    optimizer=OptimizerConfig(learning_rate=0.05)), make_mesh(MeshConfig()))
    for seed in range(3):
        learner.update(make_batch(seed))
    writer = SnapshotWriter(run.snapshots, cfg, lora=lora, base_model=str(base))
    writer.publish(learner.state.params, 4)
    writer.close()
    ckpt = TrainCheckpointer(run.checkpoints)
    ckpt.save(3, learner.state, {"step": 3, "model_config": cfg.to_hf(), "lora": adapter_config(lora, str(base))},
              force=True)
    ckpt.close()
    return run, base, learner.model()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])  # an MoE model's: on its attention
def test_a_lora_run_exports_its_peft_adapters_and_the_merged_model(tmp_path, family):
    import peft

    run, base, model = _lora_run(tmp_path, family)
    ours = _logits(model)
    assert np.abs(ours - _logits(Decoder(model.cfg, nnx.Rngs(4)))).max() > 1e-2  # trained adapters
    for i, kwargs in enumerate([{}, {"checkpoint_step": 3}]):
        out = export(run.path, tmp_path / f"adapters{i}", **kwargs)
        assert sorted(p.name for p in out.iterdir() if not p.name.startswith("tokenizer")) == [
            "adapter_config.json", "adapter_model.safetensors", "chat_template.jinja"]
        hf = transformers.AutoModelForCausalLM.from_pretrained(base)
        with torch.no_grad():
            theirs = peft.PeftModel.from_pretrained(hf, out).eval()(torch.tensor(IDS)).logits.numpy()
        np.testing.assert_allclose(theirs, ours, atol=1e-4, err_msg=str(kwargs))

        merged = export(run.path, tmp_path / f"merged{i}", merged=True, **kwargs)
        theirs, _ = _hf_logits(merged)
        np.testing.assert_allclose(theirs, ours, atol=1e-4, err_msg=str(kwargs))

    with pytest.raises(ExportError, match="a different model"):
        other = tmp_path / "other"
        from jaxrl.models import save_pretrained

        save_pretrained(_model(tiny_config("qwen3", vocab_size=100), 0), other)
        export(run.path, tmp_path / "bad", merged=True, base=other)
    plain, _ = _write_run(tmp_path / "plain", "qwen3", checkpoint=False)
    with pytest.raises(ExportError, match="trained every weight"):
        export(plain.path, tmp_path / "bad2", merged=True)


def test_the_cli_exports_a_lora_run_merged(tmp_path):
    run, base, model = _lora_run(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "jaxrl.run.cli", "export", str(run.path), "--out",
                           str(tmp_path / "m"), "--merged"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    theirs, _ = _hf_logits(tmp_path / "m")
    np.testing.assert_allclose(theirs, _logits(model), atol=1e-4)
