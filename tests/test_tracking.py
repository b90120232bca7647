"""Run tracking: metrics.jsonl, samples, TensorBoard event files, W&B routing, resume, progress bar."""

import json
import os
import struct
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from jaxrl.run.tracking import MetricsLogger, Progress, log_file, read_metrics

ROOT = Path(__file__).resolve().parents[1]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _tensorboard_events(run_dir):
    """Every event in the run's TensorBoard files, read with the TFRecord framing."""
    from tensorboardX.proto.event_pb2 import Event

    events = []
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            events.append(Event.FromString(data[offset + 12: offset + 12 + length]))  # u64 length, u32 crc
            offset += 12 + length + 4  # record, u32 crc
    return events


def _tensorboard_scalars(run_dir):
    return [(v.tag, e.step, v.simple_value) for e in _tensorboard_events(run_dir) for v in e.summary.value]


def test_log_writes_json_lines_with_nan_as_null(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"reward/mean": 0.5, "kl": np.float32(0.25), "loss": float("nan")})
        # Flushed at every step: a reader (or a kill) sees the row at once.
        assert _lines(tmp_path / "metrics.jsonl")[0]["reward/mean"] == 0.5
        logger.log(2, {"reward/mean": float("inf"), "completion_tokens": np.int64(7)})
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["kl"] == 0.25 and rows[0]["loss"] is None
    assert rows[1]["reward/mean"] is None and rows[1]["completion_tokens"] == 7.0
    assert all(isinstance(r["time"], float) for r in rows)
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()


def test_non_numeric_metric_is_named(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger, pytest.raises(TypeError, match="metric 'mode'"):
        logger.log(1, {"mode": "sync"})


def test_samples_are_appended_as_valid_json(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.samples(3, [{"prompt": "p", "completion": "c", "reward": float("nan"), "ids": np.arange(3)},
                           {"prompt": "q", "completion": "d", "reward": 1.0, "path": tmp_path}])
    rows = _lines(tmp_path / "samples.jsonl")
    assert rows[0] == {"step": 3, "prompt": "p", "completion": "c", "reward": None, "ids": [0, 1, 2]}
    assert rows[1]["reward"] == 1.0 and rows[1]["path"] == str(tmp_path)


def test_read_metrics_skips_a_truncated_last_line_and_reopening_repairs_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward/mean": 0.1}\n{"step": 2, "rew')
    assert read_metrics(tmp_path) == [{"step": 1, "reward/mean": 0.1}]
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(2, {"reward/mean": 0.2})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_read_metrics_names_a_corrupt_line_in_the_middle(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{oops\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON line"):
        read_metrics(tmp_path)


def test_resume_drops_rows_at_and_after_the_resumed_step(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, {"reward/mean": step / 10})
            logger.samples(step, [{"completion": str(step)}])
    # Killed after step 5, resumed from the checkpoint at step 3: steps 3.. are logged again.
    with MetricsLogger(tmp_path, resume_step=3) as logger:
        logger.log(3, {"reward/mean": 0.33})
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(tmp_path)] == [(1, 0.1), (2, 0.2), (3, 0.33)]
    assert [r["step"] for r in _lines(tmp_path / "samples.jsonl")] == [1, 2]
    # TensorBoard hides the earlier run's events from step 3 on (a purge marker).
    starts = [e.step for e in _tensorboard_events(tmp_path) if e.session_log.status == e.session_log.START]
    assert starts == [3] and ("reward/mean", 3, pytest.approx(0.33)) in _tensorboard_scalars(tmp_path)


def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"reward/mean": 0.5, "kl": 0.125})
        logger.log(2, {"reward/mean": 0.75})
    scalars = _tensorboard_scalars(tmp_path)
    assert ("reward/mean", 1, 0.5) in scalars and ("kl", 1, 0.125) in scalars
    assert ("reward/mean", 2, 0.75) in scalars


def test_tensorboard_costs_a_run_no_pytorch_import_and_leaves_torch_importable(tmp_path):
    code = f"""
import sys
from jaxrl.run.tracking import MetricsLogger
with MetricsLogger({str(tmp_path)!r}) as logger:
    logger.log(1, {{"reward/mean": 0.5}})
assert "torch" not in sys.modules, "tensorboardX imported torch"
import torch
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("reward/mean", 1, 0.5) in _tensorboard_scalars(tmp_path)


def test_wandb_gets_the_metrics_when_configured(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kwargs: calls.append(("init", kwargs)) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with MetricsLogger(tmp_path, tensorboard=False, wandb={"project": "p"}) as logger:
        logger.log(4, {"kl": 0.5})
    assert calls == [("init", {"dir": str(tmp_path), "project": "p"}), ("log", {"kl": 0.5}, 4), ("finish",)]


def test_missing_wandb_package_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(ImportError, match=r"pip install wandb`, or turn W&B logging off"):
        MetricsLogger(tmp_path / "run", wandb={"project": "p"})
    assert not (tmp_path / "run").exists()


def test_progress_shows_step_reward_and_kl_on_stderr(capsys):
    with Progress(10, initial=2) as bar:
        bar.update(3, {"reward/mean": 0.123456, "kl": 0.01, "loss": 1.0})
        bar.update(5, {"reward": 0.5})
    last = capsys.readouterr().err.split("\r")[-1]
    assert "5/10" in last and "reward=0.5" in last and "kl=0.01" in last and "loss" not in last


def test_errors_no_one_catches_in_other_threads_go_to_the_log_file_not_stderr(tmp_path, capfd):
    def library_callback():
        raise RuntimeError("Event loop is closed")

    hooks = sys.excepthook, threading.excepthook
    with log_file(tmp_path / "train.log"):
        thread = threading.Thread(target=library_callback)
        thread.start()
        thread.join()
        try:
            library_callback()
        except RuntimeError:
            sys.excepthook(*sys.exc_info())  # what a C library's PyErr_Print calls
    assert (sys.excepthook, threading.excepthook) == hooks
    assert capfd.readouterr().err == ""
    assert (tmp_path / "train.log").read_text().count("RuntimeError: Event loop is closed") == 2


def test_library_notices_go_to_the_log_file_not_the_console(tmp_path):
    """Where torch is absent (here: a torch too old for transformers, which it then disables), importing
    transformers prints "PyTorch was not found" through a stderr handler of its own; with the run's
    logging, it and the library's later warnings wait for train.log instead, and jaxrl's own still show."""
    stub = tmp_path / "site"
    (stub / "torch").mkdir(parents=True)
    (stub / "torch" / "__init__.py").write_text("__version__ = '1.0'\n")
    (stub / "torch-1.0.dist-info").mkdir()
    (stub / "torch-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 1.0\n")
    log = tmp_path / "train.log"
    script = f"""
import logging, warnings
logging.basicConfig(level=logging.WARNING, format="jaxrl train: %(message)s")
logging.getLogger().handlers[0].addFilter(lambda r: r.name.split(".")[0] in ("jaxrl", "bridge"))
from jaxrl.run.tracking import libraries_to_the_log, log_file
libraries_to_the_log()
import transformers
transformers.logging.get_logger("transformers.tokenization_utils_base").warning("a library's later warning")
warnings.warn("a library's deprecation", FutureWarning)
logging.getLogger("jaxrl.run.train").warning("ours")
with log_file({str(log)!r}):
    pass
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(stub), str(ROOT)])})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "jaxrl train: ours\n"
    written = log.read_text()
    for said in ("PyTorch was not found", "a library's later warning", "a library's deprecation"):
        assert said in written, said
