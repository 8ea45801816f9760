"""A worker process that runs one job at a time and is killed and replaced when a job runs past its time.

User code that must not run in the trainer's interpreter runs here: your own tools (tools/worker.py)
and your own reward functions (rewards/contain.py), each kind in a worker of its own (`Worker(kind,
preload)`). A Python thread cannot be stopped: a CPU-bound tool or reward past its timeout would keep
computing in the trainer's interpreter, holding the GIL and stalling the step. A process can be killed,
and what a job does to its interpreter (sys.exit, os._exit, a thread left running, a changed working
folder or torch grad mode) stays there. The worker is a fresh interpreter (`python -c`, spawned, not
forked): it inherits none of the trainer's threads, locks, CUDA context or model memory (forking a
process that holds them is unsafe), and a job in it gets copies of its arguments (the example's images
travel pickled), so it cannot change what the model trains on. It is started with subprocess, not
multiprocessing, whose 'spawn' runs the parent's main script again in the child: a script without an
`if __name__ == "__main__"` guard would start training again there. A job is a module-level
function, pickled by name and imported in the worker from the parent's `sys.path` (sent with each
job, with the parent's working folder, which each job starts in); messages travel as a
multiprocessing Connection over a socket pair.

A worker serves the whole process, started at its first job. A job has two phases: loading
(unpickling the job and its arguments, importing their modules), bounded by `LOAD_S`, then running,
bounded by the caller's timeout, so a slow import never counts against a job's time. After a
timeout or a crash the worker is killed (SIGKILL) and a new one started at once, so it is usually
ready by the next job. A worker ignores SIGINT (Ctrl-C is the trainer's to handle), exits when its
pipe closes, and a watchdog thread ends it if its parent dies, so none is left behind.

The worker leads a process group (a session) of its own, and is stopped by killing that group: a
process a job forks or spawns dies with the worker, not left behind after the run, and a job that
signals its own group (`os.killpg(0, ...)`) reaches the worker's, never the trainer's. The watchdog
likewise kills the whole group when the parent is gone. Every worker is stopped when the process
exits (`atexit`).
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

LOAD_S = 120.0
"""Seconds a worker may take to start, or to load a job (unpickle it, import its module)."""


class WorkerTimeout(Exception):
    """The job ran past its time; the worker was killed and replaced."""


class WorkerFailed(Exception):
    """The job could not run: the worker did not start, could not load the job, or died running it."""


def _watch_parent(parent_pid: int) -> None:
    """End this worker, and every process of its group (what its jobs started), once its parent is gone
    (then it is re-parented and getppid changes)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os.killpg(0, signal.SIGKILL)


BOOT = ("import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
        "from vlmrl.worker import serve; serve(int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))")
"""The worker's command (`python -c BOOT PATH FD PARENT PRELOAD`): vlmrl importable from the parent's sys.path."""


def serve(fd: int, parent_pid: int, preload: list[str]) -> None:
    """The worker's loop on the connection at file descriptor `fd`, once the modules `preload` are imported:
    for each (sys.path, working folder, pickled (job, args)) received, answer ("loaded",) once the job is
    unpickled, then ("done", job(*args)); ("failed", message) when either step raises."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    connection = Connection(fd)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    for module in preload:
        __import__(module)
    connection.send(("ready",))
    while True:
        try:
            path, folder, payload = connection.recv()
        except EOFError:  # the parent closed the pipe: done
            return
        sys.path[:] = path
        try:
            os.chdir(folder)  # a job that changed folder leaves the next one where the parent is
        except OSError:  # the parent's folder is gone: stay
            pass
        try:
            job, args = pickle.loads(payload)
        except BaseException as error:  # a module that cannot be imported here, a class that moved
            connection.send(("failed", f"cannot load it in the worker: {type(error).__name__}: {error}"))
            continue
        connection.send(("loaded",))
        try:
            answer = ("done", job(*args))
        except BaseException as error:  # the job's own failure, reported to the caller
            answer = ("failed", f"{type(error).__name__}: {error}")
        try:
            connection.send(answer)
        except Exception as error:  # a value that cannot be pickled
            connection.send(("failed", f"its result cannot be sent back: {type(error).__name__}: {error}"))


class Worker:
    """One worker process, started when first needed and replaced after a timeout or a crash; `kind`
    ("tool", "reward") names it in messages, `preload` the modules a new one imports before it is ready."""

    def __init__(self, kind: str, preload: tuple[str, ...] = ()):
        self.kind, self.preload = kind, tuple(preload)
        self._process = None
        self._connection = None
        self._ready = False
        self._lock = threading.Lock()  # one job at a time
        atexit.register(self.close)  # else it ends when it sees its pipe close or its parent gone

    @property
    def pid(self) -> int | None:
        """The worker's process id (None before the first job)."""
        return None if self._process is None else self._process.pid

    def _start(self) -> None:
        parent_end, child_end = socket.socketpair()
        command = [sys.executable, "-c", BOOT, json.dumps(sys.path), str(child_end.fileno()), str(os.getpid()),
                   json.dumps(self.preload)]
        self._process = subprocess.Popen(command, pass_fds=[child_end.fileno()], stdin=subprocess.DEVNULL,
                                         start_new_session=True)  # its own group: see the module's docstring
        child_end.close()
        self._connection, self._ready = Connection(parent_end.detach()), False

    def _stop(self) -> None:
        if self._process is not None:
            try:
                os.killpg(self._process.pid, signal.SIGKILL)  # the worker and what its jobs started
            except ProcessLookupError:  # the group is gone already
                pass
            self._process.wait()
            self._connection.close()
        self._process = self._connection = None

    def _replace(self) -> None:
        self._stop()
        self._start()

    def _answer(self, seconds: float, phase: str) -> tuple:
        """The worker's next message within `seconds`; WorkerFailed (the worker replaced) when it does not
        come or the worker died."""
        if not self._connection.poll(seconds):
            self._replace()
            raise WorkerFailed(f"the {self.kind} worker did not {phase} within {seconds:g} s")
        try:
            return self._connection.recv()
        except (EOFError, OSError):
            try:
                code = self._process.wait(1.0)
            except subprocess.TimeoutExpired:
                code = None
            self._replace()
            raise WorkerFailed(f"the {self.kind} worker stopped while it was to {phase} (exit code {code})") from None

    def run(self, job: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
        """`job(*args)` in the worker; its running (not its loading) limited to `timeout_s`. Raises
        WorkerTimeout past that, WorkerFailed when it cannot run, and pickle's own errors (or
        AttributeError, TypeError) for a job or arguments that cannot be sent."""
        payload = pickle.dumps((job, args))
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._replace()
            try:
                status, *value = self._exchange(payload, timeout_s)
            except (WorkerFailed, WorkerTimeout):
                raise
            except BaseException:  # Ctrl-C while waiting: a job may be in flight, its answer unread
                self._stop()
                raise
        if status == "failed":
            raise WorkerFailed(value[0])
        return value[0]

    def _exchange(self, payload: bytes, timeout_s: float) -> tuple:
        """Send one job to the (started) worker and return its last message."""
        if not self._ready:
            self._answer(LOAD_S, "start")
            self._ready = True
        self._connection.send((list(sys.path), os.getcwd(), payload))
        status, *value = self._answer(LOAD_S, "load the job")
        if status != "loaded":
            return (status, *value)
        if not self._connection.poll(timeout_s):
            self._replace()
            raise WorkerTimeout
        return self._answer(0.0, "finish the job")

    def close(self) -> None:
        """Stop the worker (a later job starts a new one)."""
        with self._lock:
            self._stop()

