"""Where a reward function of your own runs, and what it cannot do to the run.

The built-ins and `task` run in the trainer's process as they are: they are vlmrl's, total and quick.
A function of your own runs either

- in the reward worker (`WORKER`, a vlmrl/worker.py process of its own, as your tools have), when a
  fresh interpreter can find it by name: every `package.module:function` and `path/to/file.py:function`,
  and a function given from Python that is defined at the top level of an importable module. The
  trainer never imports its module: the function's name and signature are read in the worker
  (`in_worker`), where its module is imported first (within the worker's LOAD_S). Each call gets
  pickled copies of the keywords the function takes (the images only when it takes them, or takes
  `**kwargs`) and runs within the reward's `timeout_s`; past it the worker is killed and replaced.
  Whatever the function does to its interpreter stays there: sys.exit or os._exit ends the call (an
  error), not the run; a thread or a process it starts dies with the worker; a changed working folder
  or torch grad mode never reaches the trainer.
- in the trainer's process, contained (`in_process`), when it cannot: a function of `__main__` (a
  notebook's or a script's; the worker cannot import a script without running it again), or one given
  from Python whose module the worker cannot import (made at run time, found by a path the worker
  lacks). Any
  exception, SystemExit included, is an error of the call (KeyboardInterrupt stays the trainer's);
  the trainer's working folder and torch's grad mode, default dtype and thread count are put back after
  each call; a thread it leaves running (which would keep the process from exiting) is an error; a
  forked child that returns from it into vlmrl exits at once. The time limit: on the main thread, a
  call past `timeout_s` is interrupted by a signal (SIGALRM, sent every half second until it ends:
  Python code, sleeps and waits stop; a C extension's own loop cannot be stopped); on another thread
  nothing can interrupt it, and a call that returns past its limit is an error.

Each failure is a RewardFailed whose text completes "reward NAME (SPEC) ..." (score.py adds the prompt
and the completion); the trainer saves a checkpoint and stops on it, as on any reward error.
No torch import here: torch's settings are read through `sys.modules` when the trainer has loaded it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import pickle
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator

from vlmrl.errors import VlmrlError
from vlmrl.imports import load_object, resolve_file, split_spec
from vlmrl.worker import Worker, WorkerFailed, WorkerTimeout

TIMEOUT_S = 120.0
"""The default time limit of one call of a reward of your own (a batch), in seconds (`timeout_s`)."""
MAX_TIMEOUT_S = 3600.0
"""The longest `timeout_s`: an hour, while the whole step waits (the worker's wait overflows past about 10**8 s)."""
DESCRIBE_S = 30.0
"""Seconds the worker may take to read a function's name and signature, once its module is imported."""
INTERRUPT_EVERY_S = 0.5
"""After the limit, the signal that interrupts an in-process reward is sent again this often until it ends."""
WORKER = Worker("reward", ("vlmrl.rewards.contain",))
"""The process's reward worker, stopped when the process exits."""


class RewardFailed(Exception):
    """A reward of your own failed; the text completes "reward NAME (SPEC) ..."."""


class _NotInWorker(VlmrlError):
    """The worker could not load the function (its module does not import there, or lacks it)."""


class _TimedOut(BaseException):
    """Raised inside an in-process reward past its limit (a BaseException: `except Exception` in it lets it by)."""


def contained(spec: str, timeout_s: float) -> tuple[str, Callable[..., Any]]:
    """(the default name, the function) of the reward of your own at import path `spec`: run in the
    reward worker, or in this process when the worker cannot find it (see the module's docstring)."""
    if not 0 < timeout_s <= MAX_TIMEOUT_S:  # the config checks it too (config.MAX_REWARD_TIMEOUT_S)
        raise VlmrlError(f"reward {spec!r}: timeout_s must be > 0 and at most {MAX_TIMEOUT_S:g}; got {timeout_s}")
    module = split_spec(spec, "reward")[0]
    if module != "__main__":
        try:
            fn = InWorker(spec, timeout_s)
            return fn.__name__, fn
        except _NotInWorker:
            if module not in sys.modules:  # imported here already: given from Python (else: its import failed)
                raise
    fn = load_object(spec, "reward")
    if not callable(fn):
        raise VlmrlError(f"reward {spec!r} must name a function; got {type(fn).__name__}")
    return getattr(fn, "__name__", spec.rpartition(":")[2]), in_process(fn, timeout_s)


# --------------------------------------------------------------------------- in the reward worker


class _ByName:
    """A reward function sent to the worker by its import path: unpickled there (while the job loads,
    so its module's import never counts against the call's time) as the function itself."""

    def __init__(self, spec: str):
        self.spec = spec

    def __reduce__(self):
        return load_reward, (self.spec,)


def load_reward(spec: str) -> Callable[..., Any]:
    """The function at `spec` (in the worker)."""
    return load_object(spec, "reward")


def describe(fn: Callable[..., Any]) -> tuple[str, list[tuple[str, str, bool]] | None] | str:
    """(the function's name, its parameters as (name, kind, has a default); None: no signature to read),
    or why it is not a reward function (a worker's job)."""
    if not callable(fn):
        return f"must name a function; got {type(fn).__name__}"
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return getattr(fn, "__name__", ""), None
    return getattr(fn, "__name__", ""), [(p.name, p.kind.name, p.default is not p.empty) for p in parameters]


def call(fn: Callable[..., Any], keywords: dict[str, Any]) -> Any:
    """`fn(**keywords)` (a worker's job)."""
    return fn(**keywords)


def _signature(parameters: list[tuple[str, str, bool]]) -> inspect.Signature:
    """A signature with the names, kinds and the presence of defaults of `parameters` (the defaults stay in the worker)."""
    return inspect.Signature([inspect.Parameter(name, getattr(inspect.Parameter, kind),
                                                default=None if has_default else inspect.Parameter.empty)
                              for name, kind, has_default in parameters])


class InWorker:
    """A reward function of your own as the trainer sees it: each call runs in the reward worker."""

    def __init__(self, spec: str, timeout_s: float):
        self.spec, self.timeout_s = resolve_file(spec, None), timeout_s  # a file's path made absolute here
        try:
            described = WORKER.run(describe, (_ByName(self.spec),), DESCRIBE_S)
        except WorkerTimeout:
            raise VlmrlError(f"reward {spec!r}: reading its signature took over {DESCRIBE_S:g} s") from None
        except WorkerFailed as error:
            raise _NotInWorker(f"reward {spec!r}: {str(error).removeprefix('cannot load it in the worker: VlmrlError: ')}"
                               ) from None
        if isinstance(described, str):
            raise VlmrlError(f"reward {spec!r} {described}")
        name, parameters = described
        self.__name__ = name or spec.rpartition(":")[2]
        if parameters is not None:
            self.__signature__ = _signature(parameters)

    def __call__(self, **keywords) -> Any:
        try:
            return WORKER.run(call, (_ByName(self.spec), keywords), self.timeout_s)
        except WorkerTimeout:
            raise RewardFailed(f"ran past its {self.timeout_s:g} s limit (timeout_s) and was stopped (its reward "
                               "worker was killed)") from None
        except WorkerFailed as error:
            raise RewardFailed(f"failed in the reward worker: {error}") from None
        except (pickle.PicklingError, AttributeError, TypeError) as error:  # raised before anything was sent
            raise RewardFailed(f"cannot be sent its keywords (the reward worker gets pickled copies): "
                               f"{type(error).__name__}: {error}") from None


# --------------------------------------------------------------------------- in the trainer's process


@contextlib.contextmanager
def _trainer_state_kept() -> Iterator[None]:
    """Put back, after the block, the working folder and (when loaded) torch's grad mode, default dtype
    and thread count as they were before it."""
    folder, torch = os.getcwd(), sys.modules.get("torch")
    settings = (torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_num_threads()) if torch else None
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if os.getcwd() != folder:
                os.chdir(folder)
        if torch is not None:
            torch.set_grad_enabled(settings[0])
            torch.set_default_dtype(settings[1])
            if torch.get_num_threads() != settings[2]:
                torch.set_num_threads(settings[2])


@contextlib.contextmanager
def _time_limit(timeout_s: float) -> Iterator[None]:
    """On the main thread: interrupt the block with _TimedOut once it runs past `timeout_s` (a SIGALRM
    sent by a watchdog thread, again every INTERRUPT_EVERY_S while the block runs on: code that
    installs a SIGALRM handler of its own for a moment, as math-verify does, is reached later).
    Elsewhere signals cannot reach the thread: nothing."""
    main = threading.main_thread()
    if threading.current_thread() is not main:
        yield
        return
    done, late = threading.Event(), threading.Event()

    def interrupt(signum, frame):
        if late.is_set() and not done.is_set():
            raise _TimedOut

    def watch():
        if done.wait(timeout_s):
            return
        late.set()
        while not done.is_set():
            if signal.getsignal(signal.SIGALRM) is interrupt:
                signal.pthread_kill(main.ident, signal.SIGALRM)
            done.wait(INTERRUPT_EVERY_S)

    previous = signal.signal(signal.SIGALRM, interrupt)
    watchdog = threading.Thread(target=watch, name="vlmrl-reward-time-limit", daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        done.set()
        watchdog.join()
        signal.signal(signal.SIGALRM, previous)


def in_process(fn: Callable[..., Any], timeout_s: float) -> Callable[..., Any]:
    """`fn` called in the trainer's process, contained (see the module's docstring); same name and signature."""
    @functools.wraps(fn)
    def contained(**keywords) -> Any:
        before, pid, started = set(threading.enumerate()), os.getpid(), time.monotonic()
        try:
            with _trainer_state_kept(), _time_limit(timeout_s):
                values = fn(**keywords)
        except KeyboardInterrupt:  # the trainer's (a second Ctrl-C)
            raise
        except _TimedOut:
            raise RewardFailed(f"ran past its {timeout_s:g} s limit (timeout_s) and was interrupted; it runs in the "
                               "trainer's process (a function of __main__): define it in a module to have it run in "
                               "the reward worker, where it can be stopped whatever it does") from None
        except BaseException as error:  # SystemExit too: a reward does not end the run
            raise RewardFailed(f"failed: {type(error).__name__}: {error}") from None
        finally:
            if os.getpid() != pid:  # a child the reward forked, returning into the trainer's code
                os._exit(0)
        left = [t.name for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]
        if left:
            raise RewardFailed(f"left a thread running ({', '.join(left)}), which keeps the process from exiting; "
                               "a reward must finish its work before it returns")
        if time.monotonic() - started > timeout_s:  # on a thread the limit could not interrupt
            raise RewardFailed(f"ran past its {timeout_s:g} s limit (timeout_s); off the main thread it cannot be "
                               "interrupted in the trainer's process")
        return values
    return contained
