"""SFT's batches: each step's reference examples drawn and made into what the loss reads, ahead.

An SFT step's host side is drawing its examples (task.example: a scene drawn, an image decoded),
running the reference trajectories' tool calls (rollout.tools) and the processor; on the census
demo that is 0.5-0.75 s of a 2.3 s step on 2 CPU cores. With `train.prefetch_batches` = d > 0, a
worker thread makes the batches of the next d steps while the model trains on this one, with its
own copy of the processor (a fast tokenizer is not safe to share between threads) and the run's
only train `RowGuard`. The worker makes the steps in order, exactly as the loop would in place
(a task is deterministic from its index, the tools and the processor from their inputs), so the
batches are the same, and a bad row or an error comes out at the step that meets it: each step's
batch carries the guard's stop reason as it stood right after that step's draw, and an error in
the worker is raised by `take` for the step it was making. 0 = each step makes its own batch.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from dataclasses import dataclass

from vlmrl.rollout.completions import Completions
from vlmrl.safety.bad_rows import RowGuard
from vlmrl.tasks import Task


@dataclass
class StepBatch:
    """One SFT step's batch of this process: the indices asked for and those used (a bad row replaced),
    what the loss reads, and the row guard's stop reason after the draw (on_bad_row=error)."""

    wanted: list[int]
    used: list[int]
    references: Completions
    stop: str | None
    seconds: float  # making it, wherever it was made
    ahead: bool = False  # made by the worker

    def metrics(self, waited: float) -> dict[str, float]:
        """time/data: the seconds this step's path spent on its batch (making it, or `waited` for the
        worker); time/data_ahead: the worker's seconds on it, hidden behind the model."""
        return {"time/data": waited if self.ahead else self.seconds, "time/data_ahead": self.seconds if self.ahead else 0.0}


class SftBatches:
    """`take(step)`: step `step`'s batch, made by the worker `depth` steps ahead or, with depth 0, now.

    `indices(step)`: the example indices this process draws at `step`; `make(examples, processor)`:
    a step's examples made into its `Completions` (sft.reference_batch)."""

    def __init__(self, task: Task, processor, limit: int | None, indices, make, start: int, steps: int, depth: int):
        self.indices, self.make, self.depth = indices, make, depth
        self.processor = copy.deepcopy(processor) if depth else processor  # the worker's own (module doc)
        self.rows = RowGuard(task, self.processor, limit=limit)
        self.start, self.steps = start, steps
        self.ready: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self.closed = threading.Event()
        self.thread = None
        if depth:
            self.thread = threading.Thread(target=self._work, name="vlmrl-sft-batches", daemon=True)
            self.thread.start()

    def batch(self, step: int, ahead: bool = False) -> StepBatch:
        """Step `step`'s batch, made now (`ahead`: by the worker)."""
        started = time.perf_counter()
        wanted = self.indices(step)
        used, examples = self.rows.checked(wanted, data_rows_only=True)  # a bad one replaced (skip) or noted (error)
        references = self.make(examples, self.processor)
        return StepBatch(wanted, used, references, self.rows.stop, time.perf_counter() - started, ahead)

    def take(self, step: int) -> tuple[StepBatch, float]:
        """Step `step`'s batch (steps are taken in order) and the seconds waited for it; raises what
        making it raised."""
        if self.thread is None:
            return self.batch(step), 0.0
        started = time.perf_counter()
        made, item = self.ready.get()
        waited = time.perf_counter() - started
        if made != step:  # the worker makes start, start + 1, ... and the loop takes them in that order
            raise RuntimeError(f"SFT batches out of order: step {step} asked, step {made} made")
        if isinstance(item, BaseException):
            raise item
        return item, waited

    def close(self) -> None:
        """Stop the worker after the batch it is making, and wait for it: no thread is left inside a
        task's or the processor's native code when the interpreter exits (prefetch.py's close)."""
        self.closed.set()
        while self.thread is not None and self.thread.is_alive():
            try:
                self.ready.get_nowait()  # room for the put it may be blocked on
            except queue.Empty:
                self.thread.join(timeout=0.05)

    def _work(self) -> None:
        for step in range(self.start, self.steps):
            if self.closed.is_set():
                return
            try:
                item: StepBatch | BaseException = self.batch(step, ahead=True)
            except BaseException as error:  # noqa: BLE001 - raised by take() at the step that needs it
                item = error
            self.ready.put((step, item))
            if isinstance(item, BaseException):
                return
