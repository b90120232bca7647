"""Where a sweep's runs train: `local` (this machine, up to `parallel` runs at once) or `slurm`
(one SLURM job per run, submitted through submitit).

Whichever launches it, a run is one `jaxrl train` whose output goes to RUN/logs/console.log and
whose state (running, done, failed with its error line, stopped by a signal) goes to
RUN/launch.json, which `jaxrl sweep status` reads.

Local runs each get their own process group (Ctrl-C reaches the sweep, which passes it on to each
run once: the run checkpoints and stops its bridge and environment servers), their own ports
(every child binds port 0) and a share of the machine: a disjoint set of CPUs (`taskset`; XLA
sizes its thread pools from the CPUs a process may use) and of the GPUs (CUDA_VISIBLE_DEVICES).

A SLURM run starts one `jaxrl train --resume` task per node (`srun`); they join one
`jax.distributed` run, which reads its coordinator and ranks from SLURM's task environment. A
preempted or timed-out job (SLURM's USR2 warning) stops its run at a checkpoint and is requeued
by submitit; a job requeued by SLURM (`scontrol requeue`, node failure) resumes the same way; a
run that fails while training (exit code 1) is started again from its last checkpoint, up to
`retries` times.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxrl.options import option
from jaxrl.run.typed_config import ConfigError

STATE_FILE = "launch.json"
CONSOLE_LOG = "console.log"  # under RUN/logs/
FAILED_WHILE_RUNNING = 1  # `jaxrl train`'s exit code for a run that failed after it started


@dataclasses.dataclass(frozen=True)
class SlurmSpec:
    partition: str | None = option("null: the cluster's default", default=None)
    nodes: int = option("nodes per run; one `jaxrl train` task on each", default=1)
    tasks_per_node: int = option(
        "`jaxrl train` processes per node (1: one process drives all the node's devices)", default=1)
    gpus_per_node: int | None = option("GPUs per node; null: none asked", default=None)
    cpus_per_task: int | None = option("null: the cluster's default", default=None)
    mem_gb: float | None = option("memory per node; null: the default", default=None)
    time_min: int = option("time limit of a job, in minutes", default=60)
    account: str | None = option("null: the user's default account", default=None)
    sbatch: dict[str, Any] = option(
        "further sbatch options, passed as they are: {qos: high, exclusive: true}", default_factory=dict)
    setup: list[str] = option(
        "shell lines run before the job's tasks (module load, source venv)", default_factory=list)
    retries: int = option("times a run that failed while training starts again from its checkpoint", default=2)

    def __post_init__(self):
        if self.nodes < 1 or self.tasks_per_node < 1 or self.time_min < 1 or self.retries < 0:
            raise ValueError("nodes, tasks_per_node and time_min must be >= 1, retries >= 0")


# ---- one run ----------------------------------------------------------------------------


def read_state(run_dir: str | Path) -> dict[str, Any] | None:
    """RUN/launch.json, or None when the run has not started."""
    try:
        return json.loads((Path(run_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def _write_state(run_dir: Path, state: dict[str, Any]) -> None:
    path = run_dir / STATE_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def error_line(log: Path, since: int = 0) -> str | None:
    """The run's own error line (`jaxrl train: error: ...`) in its console log from byte `since`, else
    its last line."""
    try:
        with open(log, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
    except OSError:
        return None
    errors = [line for line in lines if line.startswith("jaxrl train: error")]
    return (errors or lines or [None])[-1]


def run_train(command: Sequence[str], run_dir: str | Path, stream: bool, env: Mapping[str, str] | None = None,
              own_group: bool = False, on_start: Callable[[subprocess.Popen], None] = lambda proc: None,
              job_id: str | None = None, log_name: str = CONSOLE_LOG, record: bool = True,
              ignore: Sequence[signal.Signals] = (), stopping: Callable[[], bool] = lambda: False) -> int:
    """Runs one `jaxrl train` to its end; returns its exit code (127 if it cannot start).

    Its output (stderr merged) goes to RUN/logs/`log_name` and, with `stream`, to our stdout. With
    `record`, its state goes to RUN/launch.json: running, then done (0), stopped (a signal) or
    failed (with its error line); stopped too when `stopping()` says its launcher was stopping it.
    `own_group`: in a process group of its own, so that a terminal's Ctrl-C reaches only the
    launcher, which passes it on. `ignore`: signals the run and its children ignore (unless they
    handle them).
    """
    run_dir = Path(run_dir)
    log = run_dir / "logs" / log_name
    log.parent.mkdir(parents=True, exist_ok=True)
    state = {"state": "running", "host": socket.gethostname(), "job_id": job_id, "started": time.time()}
    with open(log, "ab") as out:
        since = out.tell()  # the log keeps earlier sessions' output
        try:
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=own_group,
                                    preexec_fn=(lambda: [signal.signal(s, signal.SIG_IGN) for s in ignore])
                                    if ignore else None)
        except OSError as e:
            message = f"cannot start {shlex.join(command)}: {e.strerror}"
            out.write(f"{message}\n".encode())
            print(f"jaxrl sweep: {message}", file=sys.stderr, flush=True)
            code = 127  # the shell's code for a command that cannot run
        else:
            if record:
                _write_state(run_dir, {**state, "pid": proc.pid})
            on_start(proc)
            with proc:
                for line in proc.stdout:
                    out.write(line)
                    out.flush()
                    if stream:
                        sys.stdout.buffer.write(line)
                        sys.stdout.flush()
                code = proc.wait()
    if record:
        signalled = code < 0 or code >= 128 or stopping()
        _write_state(run_dir, {**state, "state": "done" if code == 0 else "stopped" if signalled else "failed",
                               "exit_code": code, "ended": time.time(),
                               "error": None if code == 0 else error_line(log, since)})
    return code


# ---- local ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Slot:
    """A share of this machine that one run at a time uses."""

    cpus: tuple[int, ...]
    gpus: tuple[str, ...] | None  # CUDA_VISIBLE_DEVICES; None: leave it as it is

    def command(self, command: Sequence[str]) -> list[str]:
        return ["taskset", "-c", ",".join(map(str, self.cpus)), *command] if shutil.which("taskset") else list(command)

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        return {**base, "CUDA_VISIBLE_DEVICES": ",".join(self.gpus)} if self.gpus is not None else dict(base)


def visible_gpus(environ: Mapping[str, str] = os.environ, dev: Path = Path("/dev")) -> list[str]:
    """NVIDIA GPUs this process may use: CUDA_VISIBLE_DEVICES's list, else the /dev/nvidiaN devices."""
    if environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return [d for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    found = [p.name[len("nvidia"):] for p in dev.glob("nvidia[0-9]*") if p.name[len("nvidia"):].isdigit()]
    return sorted(found, key=int)


def slots(parallel: int, cpus: Sequence[int], gpus: Sequence[str]) -> list[Slot]:
    """`parallel` shares of `cpus` and `gpus`, disjoint and as even as they divide; with fewer CPUs
    than runs, runs share them round-robin. ConfigError with fewer GPUs than runs."""
    if gpus and len(gpus) < parallel:
        raise ConfigError(f"parallel: {parallel} runs at once need at least {parallel} GPUs; this machine has "
                          f"{len(gpus)} ({','.join(gpus)}): lower `parallel`")
    cpus = sorted(cpus)

    def share(items, i):
        return tuple(items[i * len(items) // parallel:(i + 1) * len(items) // parallel])

    return [Slot(share(cpus, i) if len(cpus) >= parallel else (cpus[i % len(cpus)],),
                 share(list(gpus), i) if gpus else None) for i in range(parallel)]


@dataclasses.dataclass(frozen=True)
class LocalRun:
    name: str
    command: list[str]
    run_dir: Path


class _LocalQueue:
    """The runs of a local sweep waiting for a slot, those running, and their exit codes; shared by
    the slots' threads (under `lock`) and the main thread, which alone takes Ctrl-C."""

    def __init__(self, runs: Sequence[LocalRun], parallel: int, say: Callable[[str], None]):
        self.queue, self.total, self.parallel, self.say = list(runs), len(runs), parallel, say
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.running: dict[str, subprocess.Popen] = {}
        self.codes: dict[str, int] = {}
        self.active = slots(parallel, sorted(os.sched_getaffinity(0)), visible_gpus())

    def _started(self, name: str, proc: subprocess.Popen) -> None:
        with self.lock:
            self.running[name] = proc
            if self.stopping.is_set():  # Ctrl-C came between its start and now
                proc.send_signal(signal.SIGINT)

    def work(self, slot: Slot) -> None:
        """Runs queued runs in `slot` one after another until the queue is empty or Ctrl-C."""
        try:
            while (run := self._next()) is not None:
                self._run(slot, *run)
        finally:
            with self.lock:
                self.active.remove(slot)

    def _next(self) -> tuple[LocalRun, int] | None:
        with self.lock:
            if self.stopping.is_set() or not self.queue:
                return None
            run = self.queue.pop(0)
            return run, self.total - len(self.queue)

    def _run(self, slot: Slot, run: LocalRun, number: int) -> None:
        parallel = self.parallel
        where = f" on CPUs {','.join(map(str, slot.cpus))}" if parallel > 1 else ""
        self.say(f"run {number}/{self.total}: {run.name}{where}")
        begin = time.monotonic()
        code = run_train(slot.command(run.command) if parallel > 1 else run.command, run.run_dir,
                         stream=parallel == 1, env=slot.environ(os.environ), own_group=True,
                         stopping=self.stopping.is_set, on_start=lambda proc: self._started(run.name, proc))
        with self.lock:
            self.running.pop(run.name, None)
            self.codes[run.name] = code
        if code == 0:
            self.say(f"{run.name} done in {time.monotonic() - begin:.0f} s")
        elif not self.stopping.is_set():
            line = error_line(run.run_dir / "logs" / CONSOLE_LOG) if parallel > 1 else None
            self.say(f"{run.name} failed (exit code {code}); going on" + (f": {line}" if line else ""))

    def done(self) -> bool:
        with self.lock:
            return not self.active

    def interrupt(self, first: bool) -> None:
        """Ctrl-C: SIGINT to every running run; no queued run starts."""
        self.stopping.set()
        with self.lock:
            for proc in self.running.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
            names = ", ".join(self.running) or "no run"
        if first:
            self.say(f"interrupted: stopping {names} at a checkpoint; the queued runs do not start "
                     "(Ctrl-C again: stop at once)")


def launch_local(runs: Sequence[LocalRun], parallel: int, say: Callable[[str], None]) -> tuple[dict[str, int], bool]:
    """Trains `runs`, up to `parallel` at once, each in a slot of its own (output streamed when one at
    a time); returns (exit code by run name for those that ran, whether Ctrl-C stopped the sweep).

    Ctrl-C: every running run gets one SIGINT (it checkpoints and shuts down its children) and no
    queued run starts; a second Ctrl-C passes a second SIGINT (a run then stops at once).
    """
    sweep = _LocalQueue(runs, parallel, say)
    for i, slot in enumerate(list(sweep.active)):
        threading.Thread(target=sweep.work, args=(slot,), name=f"sweep-slot-{i}", daemon=True).start()
    interrupts = 0
    # Polled, not joined: a Thread.join that Ctrl-C interrupts may leave its thread marked as ended.
    while True:
        try:
            if sweep.done():
                break
            time.sleep(0.2)
        except KeyboardInterrupt:
            interrupts += 1
            sweep.interrupt(first=interrupts == 1)
    return sweep.codes, interrupts > 0


# ---- SLURM ------------------------------------------------------------------------------


class TrainJob:
    """The callable a SLURM job runs (through submitit), on every task: `command` (`jaxrl train CONFIG
    --resume`) until it is done, stopped, or failed more than `retries` times in a row."""

    def __init__(self, command: Sequence[str], run_dir: str | Path, retries: int):
        self.command, self.run_dir, self.retries = list(command), str(run_dir), retries
        self._proc: subprocess.Popen | None = None
        self._terminated = False

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_proc", "_terminated")}

    def __setstate__(self, state):
        self.__dict__.update(state, _proc=None, _terminated=False)

    def __call__(self) -> int:
        import submitit

        job = submitit.JobEnvironment()
        rank = job.global_rank
        # SLURM sends SIGTERM to every process of a job it cancels, requeues or preempts: the run stops
        # at a checkpoint by itself; here it only means "do not start it again".
        signal.signal(signal.SIGTERM, self._terminating)
        for _ in range(self.retries + 1):
            # SLURM's time warning (USR2, for submitit's handler here) reaches every process of the
            # step too: the run and its bridge and environment servers ignore it.
            code = run_train(self.command, self.run_dir, stream=True, job_id=job.job_id, on_start=self._started,
                             log_name=CONSOLE_LOG if rank == 0 else f"console.rank{rank}.log", record=rank == 0,
                             ignore=(signal.SIGUSR2,), stopping=lambda: self._terminated)
            if code != FAILED_WHILE_RUNNING or self._terminated:
                break
            print("jaxrl sweep: the run failed; starting it again from its last checkpoint", file=sys.stderr,
                  flush=True)
        if code != 0:
            raise RuntimeError(f"jaxrl train exited with code {code}: "
                               f"{error_line(Path(self.run_dir) / 'logs' / CONSOLE_LOG)}")
        return code

    def _started(self, proc: subprocess.Popen) -> None:
        self._proc = proc

    def _terminating(self, signum, frame) -> None:
        self._terminated = True

    def checkpoint(self):
        """Preempted or out of time (SLURM's USR2): the run stops at a checkpoint; submitit requeues
        this job, which then resumes it."""
        import submitit

        self._terminated = True
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            self._proc.wait()
        return submitit.helpers.DelayedSubmission(TrainJob(self.command, self.run_dir, self.retries))


def launch_slurm(runs: Sequence[LocalRun], spec: SlurmSpec, folder: Path, name: str) -> list[str]:
    """Submits one job per run (one job array) through submitit; returns their job ids. Logs go to
    `folder`/<job id>/."""
    import submitit

    if shutil.which("sbatch") is None:
        raise ConfigError("launcher: slurm needs SLURM's sbatch on this machine's PATH (submit from a login node)")
    executor = submitit.SlurmExecutor(folder=folder / "%j")
    optional = {"partition": spec.partition, "account": spec.account, "cpus_per_task": spec.cpus_per_task,
                "gpus_per_node": spec.gpus_per_node, "mem": None if spec.mem_gb is None else f"{spec.mem_gb:g}GB"}
    executor.update_parameters(
        job_name=name, nodes=spec.nodes, ntasks_per_node=spec.tasks_per_node, time=spec.time_min,
        setup=list(spec.setup), additional_parameters={"requeue": True, **spec.sbatch},
        **{k: v for k, v in optional.items() if v is not None})
    try:
        with executor.batch():
            jobs = [executor.submit(TrainJob(run.command, run.run_dir, spec.retries)) for run in runs]
    except (submitit.core.utils.FailedJobError, subprocess.CalledProcessError) as e:
        raise ConfigError(f"sbatch refused the sweep's jobs: {str(e).strip().splitlines()[-1]}") from None
    return [job.job_id for job in jobs]


def slurm_states(job_ids: Sequence[str]) -> dict[str, str]:
    """Job id -> SLURM state (PENDING, RUNNING, ...) of those jobs SLURM still lists."""
    if not job_ids or shutil.which("squeue") is None:
        return {}
    out = subprocess.run(["squeue", "-h", "-r", "-o", "%i %T", "-j", ",".join(job_ids)], capture_output=True, text=True)
    states = dict(line.split(None, 1) for line in out.stdout.splitlines() if line.strip())
    return {job: states[job].strip() for job in job_ids if job in states}


def cancel_slurm(job_ids: Sequence[str]) -> None:
    subprocess.run(["scancel", *job_ids], check=False)
