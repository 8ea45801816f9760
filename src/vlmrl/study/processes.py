"""The runs of a study (compare.py) as processes: started, stopped on request, and what became of each.

Each run is `python -m vlmrl train|sft ...` in its own session (process group), with its output in
RUN/run.log. In its own session, a run is not reached by what the terminal sends the study's
group: Ctrl-C reaches the study alone, which passes it on once (`StopForwarder`). Had it reached
both, the run would count the study's forward as a second signal and exit at once without a
checkpoint. So while `StopForwarder` is entered:

- a SIGINT or SIGTERM to the study is passed on, as the same signal, to every running run, which
  finishes its step, saves a checkpoint and exits (faults.StopSignals); no new run starts, and the
  study waits for the running ones to end before it stops (`Stopped`): no run is left behind. A
  second signal (a second or more later) is passed on too: the runs stop at once, their last
  checkpoint whole;
- a run stopped by a signal sent to it alone (exit 130 / 143, or killed by one) is an `Outcome`
  that says where it continues; the other runs go on.

A study killed outright (SIGKILL) cannot pass anything on: on Linux each run has asked the kernel
for a SIGTERM when the study dies (faults.stop_with_parent), so it stops after its step with a
checkpoint as if the study had passed one on, and the same command continues it. Elsewhere the
runs train on to their end, and the study started again refuses their folders while they do
(folder_lock.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from vlmrl.safety.faults import STOP_WITH_PARENT

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class Job:
    """One run to start: its name (arm/seed_s), its folder and its command line."""

    name: str
    folder: Path
    argv: list[str]


def finished(folder: Path) -> bool:
    """Whether the run in `folder` has ended: its final model and its metrics are there."""
    return (folder / "final").is_dir() and (folder / "metrics.jsonl").is_file()


def checkpoint_step(folder: Path) -> int | None:
    """The step of the run's newest checkpoint (the one it resumes from), or None."""
    root = folder / "checkpoints"
    steps = [int(match.group(1)) for path in (root.iterdir() if root.is_dir() else [])
             if (match := _STEP_DIR.match(path.name))]
    return max(steps, default=None)


@dataclass
class Outcome:
    """How a run's process ended."""

    job: Job
    returncode: int

    @property
    def done(self) -> bool:
        return self.returncode == 0 and finished(self.job.folder)

    @property
    def stop_signal(self) -> int | None:
        """The signal that stopped the run: with a checkpoint (the CLI's exit 130 or 143), or at once
        (killed by it); None when it ended by itself."""
        if self.returncode < 0:
            return -self.returncode
        return self.returncode - 128 if self.returncode - 128 in STOP_SIGNALS else None

    def describe(self) -> str:
        """What happened to the run and where it continues, for a one-line message."""
        name, signum = self.job.name, self.stop_signal
        if signum is None:
            return f"{name} failed (exit {self.returncode}; see {self.job.folder / 'run.log'})"
        step = checkpoint_step(self.job.folder)
        where = f"continues from its checkpoint at step {step}" if step else "starts again from step 0"
        return f"{name} stopped by {signal.Signals(signum).name}: {where}"


class StopForwarder:
    """While entered (in the main thread): SIGINT and SIGTERM to this process are recorded in
    `received` and passed on to every run process `adopt`ed, instead of stopping this process."""

    def __init__(self):
        self.received: list[int] = []
        self.children: list[subprocess.Popen] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopForwarder:
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}
        return self

    def __exit__(self, *exception) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def _on_signal(self, signum: int, frame) -> None:
        self.received.append(signum)
        name = signal.Signals(signum).name
        again = "" if len(self.received) > 1 else " (send it again to stop them at once)"
        os.write(2, f"\n{name} received: the running runs save a checkpoint after their step, then the study "
                    f"stops{again}\n".encode())  # not print(): the handler may interrupt a write to stderr
        for process in list(self.children):
            process.send_signal(signum)

    def adopt(self, process: subprocess.Popen) -> None:
        """Forward to `process` from now on, and what came while it was starting."""
        self.children.append(process)
        for signum in self.received:
            process.send_signal(signum)

    def forget(self, process: subprocess.Popen) -> None:
        self.children.remove(process)


def start(job: Job, threads: int) -> subprocess.Popen:
    """The job's process, in its own session, `threads` torch threads, its output to FOLDER/run.log."""
    job.folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **{STOP_WITH_PARENT: str(os.getpid())})
    with (job.folder / "run.log").open("a") as log:  # the child keeps its own copy of the file
        log.write(f"$ {' '.join(job.argv)}\n")
        log.flush()
        return subprocess.Popen(job.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@contextlib.contextmanager
def ending_children_on_error(stops: StopForwarder):
    """Within: should this process fail (a bug), its runs are asked to stop (SIGTERM, unless a
    signal was passed on already: a second would stop them without a checkpoint) and waited for."""
    try:
        yield
    except BaseException:
        for process in stops.children if not stops.received else []:
            process.terminate()
        for process in stops.children:
            process.wait()
        raise


def execute(jobs: list[Job], parallel: int, threads: int, label: str, stops: StopForwarder) -> list[Outcome]:
    """Run the unfinished `jobs`, `parallel` at a time with `threads` threads each, under one progress
    bar, until they end or a stop signal comes (`stops`); the outcome of each run started, in the
    order of `jobs`."""
    pending = [job for job in jobs if not finished(job.folder)]
    ended: dict[str, Outcome] = {}
    active: dict[str, tuple[Job, subprocess.Popen]] = {}
    with tqdm(total=len(jobs), initial=len(jobs) - len(pending), desc=label, unit="run", dynamic_ncols=True) as bar, \
            ending_children_on_error(stops):
        while active or (pending and not stops.received):
            while pending and len(active) < parallel and not stops.received:
                job = pending.pop(0)
                process = start(job, threads)
                stops.adopt(process)
                active[job.name] = (job, process)
                bar.set_postfix_str(", ".join(active))  # which runs are going
            time.sleep(0.2)
            for name, (job, process) in list(active.items()):
                if process.poll() is None:
                    continue
                del active[name]
                stops.forget(process)
                ended[name] = Outcome(job, process.returncode)
                bar.update(0 if ended[name].stop_signal else 1)  # a stopped run is still to do
    return [ended[job.name] for job in jobs if job.name in ended]  # not in the order they ended
