"""What a run does when something goes wrong mid-way: a non-finite loss or gradient, a stop signal.

Numerical faults. One NaN or inf in the loss or the gradient (a bad batch, an fp16 overflow, a
log-prob of a token the model gives probability 0) would poison the weights and AdamW's moments
for good. `NumericGuard.step` checks every optimizer update: when the loss or the gradient norm is
not finite on any process, the update is skipped (gradients zeroed, no optimizer step) and counted
(`skipped_steps` in the metrics, cumulative over the run). The learning-rate schedule still
advances, on purpose: the learning rate stays a function of the step number, as in a run that
never skipped, and a skipped update is simply an update of zero. `train.max_bad_steps` skipped
updates in a row stop the run with a checkpoint and a VlmrlError: something upstream is broken,
and the checkpoint holds the last good weights (skipped updates change nothing).

Stop signals. `StopSignals` turns the first SIGINT (Ctrl-C) or SIGTERM (a scheduler pre-empting
the job) into a request: the step in progress finishes, a checkpoint is saved and the run ends
with `Interrupted` (exit status 130 for SIGINT, 143 for SIGTERM from the CLI). A second signal
acts as it would without vlmrl (KeyboardInterrupt, or the default kill) and saves nothing; the
last checkpoint stays whole, since checkpoints are renamed into place. Signals within SAME_STOP_S
of the first are not a second one: one stop often comes from several senders at once (a terminal's
Ctrl-C to a process group, a scheduler that signals every process of a job, and the `vlmrl compare`
that passes it on), and must not cost the checkpoint. `vlmrl compare` also starts its runs in their
own process group, so a terminal's Ctrl-C reaches a run only through the study (study/processes.py).
A run started with STOP_WITH_PARENT set to its parent's process id (a study's runs) asks Linux for a
SIGTERM when that parent dies (`stop_with_parent`): a study killed outright (SIGKILL) cannot pass a
stop on, and its runs stop after their step with a checkpoint all the same. The processes of
`accelerate launch` (or torchrun) follow their launcher the same way (`parent_to_follow`).

A lost process. When a process of a multi-process run dies (killed, out of memory, its machine
gone), the others learn it at their next collective, from the process group: gloo's "Connection
closed by peer" at once when the dead process's connections were closed (its machine is up), else
the group's timeout (30 minutes for gloo, 10 for NCCL). `lost_process` recognises that error, and
the session turns it into one line naming the last complete checkpoint (training/session.py).
"""

from __future__ import annotations

import functools
import math
import os
import signal
import sys
import threading
import time
import warnings
import weakref

import torch

from vlmrl.errors import warn

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_WITH_PARENT = "VLMRL_STOP_WITH_PARENT"
"""Environment variable: the process id of a parent whose death stops this run as a SIGTERM would."""
PR_SET_PDEATHSIG = 1  # linux/prctl.h

SAME_STOP_S = 1.0
"""Stop signals this many seconds or less after the first are the same request (see the module doc)."""


MAIN_FIRST_S = 2.0
"""Seconds a process other than the main one waits before it leaves on an error that the main process
met and says (training/session.py `on_main`: a full disk while saving, a refusal before step 1): the
main process prints its line and ends first, so the launcher names it as the run's failure and does
not stop it (SIGTERM) before its line is out, and no other process's error stands in its place."""


LOST_PROCESS_SIGNS = ("gloo/transport/", "Connection closed by peer", "Connection reset by peer")
"""Words of torch.distributed's errors when a peer is gone: gloo raises a plain RuntimeError from its
TCP transport (third_party/gloo/gloo/transport/tcp/pair.cc: "Connection closed by peer [ip]:port")."""


def lost_process(error: BaseException) -> bool:
    """Whether `error` says another process of the run is gone: torch.distributed's backend or network
    error (NCCL, the store), or gloo's RuntimeError from its transport (LOST_PROCESS_SIGNS)."""
    kinds = tuple(getattr(torch.distributed, name) for name in ("DistBackendError", "DistNetworkError")
                  if hasattr(torch.distributed, name))
    if kinds and isinstance(error, kinds):
        return True
    return isinstance(error, RuntimeError) and any(sign in str(error) for sign in LOST_PROCESS_SIGNS)


def any_process(accelerator, flag: bool) -> bool:
    """True when `flag` is True on any process (a collective: every process calls it)."""
    total = accelerator.reduce(torch.tensor([float(flag)], device=accelerator.device), "sum")
    return bool(total > 0)


class OptimizerUpdate:
    """How one optimizer update is made with accelerate (one process, DDP, FSDP2): the gradients
    clipped by accelerate, then the optimizer's step, or none; the gradients cleared after. A
    DeepSpeed engine makes its updates itself (training/zero3.py: EngineUpdate, the same methods)."""

    def __init__(self, accelerator, model: torch.nn.Module, optimizer):
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer

    def norm(self, limit: float) -> float:
        """The gradient norm over all processes before clipping to `limit` (inf: no clipping)."""
        norm = self.accelerator.clip_grad_norm_(self.model.parameters(), limit)
        return float(norm) if norm is not None else 0.0

    def on_any_process(self, flag: bool) -> bool:
        return any_process(self.accelerator, flag)

    def make(self, apply: bool) -> None:
        """The optimizer step when `apply`, then the gradients cleared."""
        if apply:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class NumericGuard:
    """Skips optimizer updates whose loss or gradient norm is NaN/inf, and counts them.

    `skipped` (updates skipped since the run began) and `in_a_row` are saved in checkpoints, so
    a resumed run counts on as an uninterrupted one.
    """

    def __init__(self, max_in_a_row: int, max_grad_norm: float = 0.0):
        self.max_in_a_row = max_in_a_row
        self.max_grad_norm = max_grad_norm  # clip to this norm; 0 = no clipping
        self.skipped = 0
        self.in_a_row = 0

    def step(self, update: OptimizerUpdate, scheduler, loss: float) -> float:
        """Clip the accumulated gradients, then make the `update` unless `loss` (this process's, of
        this update) or the gradient norm is not finite on some process. The scheduler steps and
        the gradients are cleared either way. Returns the gradient norm before clipping."""
        grad_norm = update.norm(self.max_grad_norm if self.max_grad_norm > 0 else math.inf)
        bad = update.on_any_process(not (math.isfinite(loss) and math.isfinite(grad_norm)))
        if bad:
            self.skipped += 1
            self.in_a_row += 1
        else:
            self.in_a_row = 0
        update.make(apply=not bad)
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()" after a skip
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            scheduler.step()
        return grad_norm

    @property
    def exhausted(self) -> bool:
        """True when max_in_a_row (> 0) updates in a row were skipped: time to stop."""
        return self.max_in_a_row > 0 and self.in_a_row >= self.max_in_a_row

    def state_dict(self) -> dict[str, int]:
        return {"skipped": self.skipped, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped, self.in_a_row = int(state.get("skipped", 0)), int(state.get("in_a_row", 0))


class StopSignals:
    """While installed, the first SIGINT or SIGTERM sets `received` (the signal number) instead of
    stopping the process; the training loop checks it after each step.

    Installed only from the main thread (Python delivers signals there). `restore()` puts the
    previous handlers back; a handler left behind by a session that died without restoring hands
    every signal to the previous handler.
    """

    def __init__(self):
        self.received: int | None = None
        self.received_at = 0.0  # time.monotonic() of the first signal
        self._previous: dict[int, object] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        this = weakref.ref(self)
        for signum in STOP_SIGNALS:
            previous = signal.getsignal(signum)
            self._previous[signum] = previous
            signal.signal(signum, functools.partial(_on_signal, this, previous))
        stop_with_parent(parent_to_follow())

    def restore(self) -> None:
        """Put back the handlers that were there before."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}


def parent_to_follow() -> str | None:
    """The process id whose death stops this run: a launcher's (`accelerate launch` and `torchrun`
    start each process with TORCHELASTIC_RUN_ID set, as their children), so that SIGKILL to the
    launcher stops its processes after their step with a checkpoint, where they used to train on to
    their end holding the run folder; else STOP_WITH_PARENT's (a study's runs), else none."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return str(os.getppid())
    return os.environ.get(STOP_WITH_PARENT)


def stop_with_parent(parent: str | None) -> bool:
    """With `parent` (a process id, from STOP_WITH_PARENT): have Linux send this process a SIGTERM
    when its parent dies (prctl PR_SET_PDEATHSIG), and send it now if the parent `parent` is gone
    already (this process was re-parented before it asked). Returns whether it was armed: never
    without `parent` or off Linux (there a killed study's runs train on to their end)."""
    if not parent or not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return False
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def _on_signal(stops_ref, previous, signum, frame) -> None:
    stops = stops_ref()
    if stops is not None and stops._previous and stops.received is None:
        stops.received, stops.received_at = signum, time.monotonic()
        warn(f"{signal.Signals(signum).name} received: stopping after this step with a checkpoint "
             "(send it again to stop at once, without one)")
        return
    if stops is not None and stops._previous and time.monotonic() - stops.received_at <= SAME_STOP_S:
        return  # the same stop, from another sender
    if stops is not None:
        stops.restore()
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
