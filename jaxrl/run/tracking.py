"""What a researcher sees while a run trains: metrics files, TensorBoard, W&B and a progress bar.

```
RUN/
  metrics.jsonl    {"step": 12, "time": 1767225600.123, "reward/mean": 0.5, ...} per logged step
  samples.jsonl    {"step": 12, ...} per completion sample
  tensorboard/     TensorBoard event files (tensorboardX)
```

metrics.jsonl is the record the reports read: always valid JSON lines (NaN and inf are null),
on disk (fsync) at every step, before the step's checkpoint, so a killed run keeps everything it logged.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from jaxrl.run.run_dir import RunDir


def _summary_writer(logdir: Path, purge_step: int | None):
    """tensorboardX's writer, imported with PyTorch hidden: where torch is installed tensorboardX
    imports it (~2 s of CPU at every run's start) only to accept torch tensors, which jaxrl never
    logs. A process that has imported torch already keeps it."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX expects
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide:
            del sys.modules["torch"]
    return SummaryWriter(str(logdir), purge_step=purge_step)


class MetricsLogger:
    """Logs each step's metrics to RUN/metrics.jsonl, TensorBoard and optionally W&B.

    An existing run directory is appended to. `resume_step`: the first step this run logs (its
    checkpoint's step + 1, or 1 when it resumes before the first checkpoint), so what an earlier
    attempt logged at or after it is dropped from metrics.jsonl and samples.jsonl, and hidden in
    TensorBoard; curves have no duplicate steps.
    `wandb`: keyword arguments for `wandb.init` (None: no W&B).
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, wandb: dict | None = None,
                 resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        # W&B first: a missing package should fail before anything is written.
        self._wandb = _start_wandb(wandb, self.run_dir) if wandb is not None else None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        metrics_path, samples_path = RunDir(self.run_dir).metrics, self.run_dir / "samples.jsonl"
        for path in (metrics_path, samples_path):
            _trim(path, resume_step)
        self._metrics = open(metrics_path, "a")
        self._samples = open(samples_path, "a")
        self._tensorboard = None
        if tensorboard:
            self._tensorboard = _summary_writer(self.run_dir / "tensorboard", resume_step)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records `metrics` (numbers: Python, NumPy or JAX scalars) at `step`."""
        values = {key: _number(key, value) for key, value in metrics.items()}
        row = {"step": int(step), "time": round(time.time(), 3)}
        row |= {key: value if math.isfinite(value) else None for key, value in values.items()}
        self._metrics.write(json.dumps(row, allow_nan=False) + "\n")
        _sync(self._metrics)
        if self._tensorboard is not None:
            for key, value in values.items():
                self._tensorboard.add_scalar(key, value, int(step))
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=int(step))

    def samples(self, step: int, rows: list[Mapping[str, Any]]) -> None:
        """Appends completion samples (prompt, completion, reward, ...) to RUN/samples.jsonl."""
        for sample in rows:
            record = {"step": int(step), **_jsonable(dict(sample))}
            self._samples.write(json.dumps(record, allow_nan=False, default=str) + "\n")
        _sync(self._samples)

    def close(self) -> None:
        """Closes every sink, each even where one closed before it failed (a full disk fails them all)."""
        with contextlib.ExitStack() as stack:
            if self._wandb is not None:
                stack.callback(self._wandb.finish)
                self._wandb = None
            if self._tensorboard is not None:
                stack.callback(_close_tensorboard, self._tensorboard)
            for f in (self._samples, self._metrics):
                stack.callback(f.close)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close_tensorboard(writer) -> None:
    """tensorboardX's writer closed, or where its last flush fails (a full disk), stopped: each of its file
    writers has a worker thread and an exit hook that would try the disk again, each printing a traceback
    after the run's one-line error."""
    try:
        writer.close()
    except OSError:
        for file_writer in (writer.all_writers or {}).values():
            events = file_writer.event_writer
            if not events._closed:
                events._worker.stop()
                events._closed = True  # what its exit hook checks
        raise


def _sync(f) -> None:
    """On disk before the step's checkpoint: a checkpoint never gets ahead of its metrics."""
    f.flush()
    os.fsync(f.fileno())


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of RUN/metrics.jsonl, in order; a half-written last line (a killed run) is skipped."""
    path = RunDir(run_dir).metrics
    lines = path.read_text().splitlines(keepends=True)
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            if number == len(lines) and not line.endswith("\n"):
                break
            raise ValueError(f"{path}:{number}: not a JSON line: {line[:80]!r}") from None
    return rows


def _trim(path: Path, resume_step: int | None) -> None:
    """Drops a half-written last line and, on resume, the rows at steps >= `resume_step`."""
    if not path.exists():
        return
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines.pop()  # appending after it would corrupt the next row too
    if resume_step is not None:
        lines = [line for line in lines if _step_of(line) is None or _step_of(line) < resume_step]
    kept = "".join(lines)
    if kept != text:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(kept)
        os.replace(tmp, path)


def _step_of(line: str) -> int | None:
    try:
        return json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None


def _number(key: str, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"metric {key!r} must be a number, got {value!r}") from None


def _jsonable(value):
    """`value` with arrays as lists and NaN/inf as None, so that json.dumps writes valid JSON."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # NumPy / JAX arrays and scalars
        return _jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _start_wandb(kwargs: dict, run_dir: Path):
    try:
        import wandb
    except ImportError:
        raise ImportError(
            "W&B logging is configured but the wandb package is not installed: "
            "`pip install wandb`, or turn W&B logging off in the config"
        ) from None
    return wandb.init(**({"dir": str(run_dir)} | kwargs))


# Postfix name -> the metric keys it shows, first present wins.
PROGRESS_KEYS = {"reward": ("reward/mean", "reward"), "kl": ("kl",)}


class Progress:
    """A progress bar on stderr: step / total, rate, ETA, and the latest reward and KL."""

    def __init__(self, total_steps: int, initial: int = 0):
        self._bar = tqdm(total=total_steps, initial=initial, unit="step", file=sys.stderr, dynamic_ncols=True)
        self._shown: dict[str, str] = {}

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Moves the bar to `step` (absolute, not an increment); shows the latest reward and KL."""
        for name, keys in PROGRESS_KEYS.items():
            value = next((metrics[k] for k in keys if k in (metrics or {})), None)
            if value is not None:  # a step without it (e.g. no eval this step) keeps the last one
                self._shown[name] = f"{float(value):.4g}"
        self._bar.set_postfix(self._shown, refresh=False)
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Held(logging.Handler):
    """Libraries' warnings logged before the run's train.log exists, kept for it (`log_file`)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.addFilter(lambda record: not _ours(record))
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


_HELD = _Held()


def _ours(record: logging.LogRecord) -> bool:
    return record.name.split(".")[0] in ("jaxrl", "bridge")


def libraries_to_the_log() -> None:
    """Libraries' notices go to the run's train.log, never to the console (which shows jaxrl's and
    the bridge's own lines only: `jaxrl train`): those logged before train.log exists are held for
    it; Python warnings become log records like the rest; and transformers, which prints through a
    stderr handler of its own (its import says "PyTorch was not found. Models won't be available..."
    where torch is absent), is imported here with stderr caught (the handler it makes then writes
    there, whichever of its loggers speaks), then logs through the root logger as other libraries do."""
    logging.getLogger().addHandler(_HELD)
    logging.captureWarnings(True)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        from transformers.utils import logging as transformers_logging
    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()
    if said.getvalue().strip():
        _HELD.records.append(logging.LogRecord("transformers", logging.WARNING, __file__, 0, "%s",
                                               (said.getvalue().strip(),), None))


@contextlib.contextmanager
def log_file(path: Path):
    """Every warning and error logged while the run trains, libraries' too, with tracebacks, in `path`;
    so are errors no one catches in other threads (TensorStore finishing the writes Orbax abandoned at
    a full disk calls into a closed event loop, dozens of times): the run's own error is one line."""
    handler = logging.FileHandler(path)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.removeHandler(_HELD)  # what libraries said before this file existed goes first
    for record in _HELD.records:
        handler.handle(record)
    _HELD.records.clear()
    uncaught = logging.getLogger("uncaught")  # not jaxrl's: kept off stderr (see `jaxrl train`)
    hooks = sys.excepthook, threading.excepthook, sys.unraisablehook
    sys.excepthook = lambda kind, value, tb: uncaught.error("uncaught", exc_info=(kind, value, tb))
    threading.excepthook = lambda a: uncaught.error("uncaught in thread %s", a.thread and a.thread.name,
                                                     exc_info=(a.exc_type, a.exc_value, a.exc_traceback))
    sys.unraisablehook = lambda u: uncaught.error("%s: %r", u.err_msg or "ignored", u.object,
                                                  exc_info=(u.exc_type, u.exc_value, u.exc_traceback))
    try:
        yield
    finally:
        sys.excepthook, threading.excepthook, sys.unraisablehook = hooks
        root.removeHandler(handler)
        handler.close()


def sample_rows(groups: Sequence[Sequence[Any]], tokenizer, k: int) -> list[dict[str, Any]]:
    """The first trajectory of each of the first `k` groups, decoded: what samples.jsonl keeps of a step."""
    rows = []
    for group in groups[:k]:
        t = group[0]
        rows.append({"group_id": t.group_id, "env": t.env, "rewards": t.rewards, "finish_reason": t.finish_reason,
                     "prompt": tokenizer.decode(t.prompt_ids), "completion": tokenizer.decode(t.completion_ids)})
    return rows
