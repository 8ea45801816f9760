"""The run's logs written on one background thread (`train.background_logs`).

The main process hands each write to this thread and goes on: a step's row of metrics to
metrics.jsonl and TensorBoard (report/tracking.py: the sinks that are the run's own files) and the
step's rollouts to rollouts/ (report/rollout_log.py: the PNGs of its images and the JSONL). One
thread and a bounded queue (`QUEUE_SIZE` writes; a full queue holds the step up until the thread
has written one), so every file gets the same lines in the same order as when they are written on
the step's path. W&B and trackio stay on the main thread (`Trackers.log_main`): `wandb.log` is
not thread-safe (wandb/wandb#1824), and trackio documents no calls from a second thread.

`drain()` returns once every write handed over is done (each file written and closed, as on the
path): the session drains before a checkpoint is written (a crash leaves every line up to the last
checkpoint), at the run's end and when it stops on an error or a signal (`TrainingSession.close`).
A write that fails (a full disk: one line) is kept and raised on the main thread at the next
hand-off or drain. `take_seconds()` is the thread's time on the writes done since it was last
called (`time/log_write`, hidden); `time/log` is what the logs kept on the step's path.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

QUEUE_SIZE = 8
"""Writes handed over and not yet done, at most (a step hands over one or two)."""


class LogWriter:
    """One thread that runs the writes handed to it in order; `background=False` runs each at once,
    on the caller's thread (the same calls, in the same order)."""

    def __init__(self, background: bool = True) -> None:
        self.background = background
        self.failure: BaseException | None = None
        self.broken = False  # a write failed: nothing more is written (the run stops on that failure)
        self.seconds = 0.0  # the thread's time on finished writes, until `take_seconds`
        self.lock = threading.Lock()
        self.writes: queue.Queue[Callable[[], object] | None] = queue.Queue(maxsize=QUEUE_SIZE)
        self.thread: threading.Thread | None = None
        if background:  # a daemon: a run that never closes (a notebook's) does not hold the interpreter
            self.thread = threading.Thread(target=self._run, name="vlmrl-logs", daemon=True)
            self.thread.start()

    def put(self, write: Callable[[], object]) -> None:
        """Hand `write()` to the thread (after raising the failure of an earlier one); without a
        thread, run it now."""
        self._raise()
        if self.thread is None:
            write()
            return
        self.writes.put(write)

    def _run(self) -> None:
        while (write := self.writes.get()) is not None:
            started = time.perf_counter()
            try:
                if not self.broken:
                    write()
            except BaseException as error:  # noqa: BLE001 - raised on the main thread (`put`, `drain`)
                self.failure, self.broken = error, True
            finally:
                with self.lock:
                    self.seconds += time.perf_counter() - started
                self.writes.task_done()
        self.writes.task_done()

    def drain(self) -> None:
        """Wait until every write handed over is done; raise the failure of one (once)."""
        if self.thread is not None:
            self.writes.join()
        self._raise()

    def close(self) -> None:
        """Drain, then end the thread (the failure of a write is raised after it has ended)."""
        try:
            self.drain()
        finally:
            if self.thread is not None and self.thread.is_alive():
                self.writes.put(None)
                self.thread.join()
            self.thread = None

    def take_seconds(self) -> float:
        """The thread's seconds on the writes done since the last call (0.0 without a thread)."""
        with self.lock:
            seconds, self.seconds = self.seconds, 0.0
        return seconds

    def _raise(self) -> None:
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure
