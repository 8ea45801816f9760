"""The next generate calls' examples made and encoded ahead, on one background thread.

While the model generates or trains, a worker thread makes the examples of the next
`train.prefetch_batches` generate calls of this process (task.example: images read and decoded
from disk) and runs the processor on them (the image processor's resize and normalisation, the
chat template, the tokenizer), with its own copy of the processor: a fast tokenizer changes its
padding settings on every call and is not safe to share between threads. PIL's decode and resize
and numpy's arithmetic let the GIL go, so the work runs beside the model's (benchmarks/overlap_host.py).

Which calls come next is known from the layout alone: a process draws its share of a round in calls
`first`, `first + per_call`, ..., and the next round (of this step under dynamic sampling, or the
next step's first) starts `rollout.prompts_per_step` further on (`call_indices`). The trainer takes
a call's examples from the worker only when the worker made all of them without an error and none
is a known bad row; otherwise (a bad example, any failure in the worker, a call it did not foresee)
the trainer draws them itself exactly as without prefetching, so a bad row follows on_bad_row and an
error stops the run in the same one line at the step that needs the example. The examples and
tensors are the same either way: a task is deterministic from its index, and the processor's output
does not depend on the thread it runs on. A task's `example` must therefore be safe to call from a
second thread (vlmrl's tasks and the dataset task are); `train.prefetch_batches=0` turns the worker off.
"""

from __future__ import annotations

import copy
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vlmrl.rollout.prompts import encode_prompts
from vlmrl.safety.bad_rows import make_example
from vlmrl.tasks import Example, Task


@dataclass
class Prepared:
    """One generate call's examples as the worker made them, or the error that stopped it."""

    indices: list[int]
    examples: list[Example] | None = None
    prompt: dict[str, torch.Tensor] | None = None  # the processor's inputs, (B, P) each, on the CPU; None: not encoded
    error: BaseException | None = None
    seconds: float = 0.0  # the worker's wall time on it


def call_indices(first: int, per_process: int, per_call: int, prompts_per_step: int) -> Iterator[list[int]]:
    """The prompt indices of every generate call of one process from the round that starts at `first`
    on: that round's calls, then the next round's (`prompts_per_step` further), without end."""
    while True:
        for start in range(first, first + per_process, per_call):
            yield list(range(start, start + per_call))
        first += prompts_per_step


class Prefetcher:
    """A worker thread preparing up to `depth` calls ahead; `take(indices, first)` gives a call's."""

    def __init__(self, task: Task, processor, limit: int | None, encode: bool, depth: int):
        self.task, self.limit, self.encode, self.depth = task, limit, encode, depth
        self.processor = copy.deepcopy(processor)  # the worker's own (see the module doc)
        self.requests: queue.Queue = queue.Queue()
        self.pending: deque[tuple[list[int], queue.Queue]] = deque()
        self.plan: Iterator[list[int]] | None = None
        self.closed = threading.Event()  # set by `close`: the worker takes no further request
        self.thread = threading.Thread(target=self._work, name="vlmrl-prefetch", daemon=True)
        self.thread.start()

    def take(self, indices: list[int], first: int, layout: tuple[int, int, int]) -> tuple[Prepared | None, float]:
        """The worker's result for the call of `indices` (in the round starting at `first`, of the
        layout (per_process, per_call, prompts_per_step)) and the seconds waited for it; (None, 0) when
        it was not foreseen. Then asks the worker for the calls after it, up to `depth` ahead."""
        while self.pending and self.pending[0][0] != indices:
            self.pending.popleft()  # foreseen but never asked for: its result is dropped
        found, waited = None, 0.0
        if self.pending:
            started = time.perf_counter()
            found = self.pending.popleft()[1].get()
            waited = time.perf_counter() - started
        else:  # a call not foreseen (the first one): plan from here, when it is one of its round's calls
            per_process, per_call, _ = layout
            self.plan = call_indices(first, *layout)
            if indices not in itertools.islice(self.plan, -(-per_process // per_call)):  # consumed up to it
                self.plan = None  # off the layout's grid: nothing foreseen, the trainer draws it
                return None, 0.0
        while len(self.pending) < self.depth:
            upcoming = next(self.plan)
            answer: queue.Queue = queue.Queue(maxsize=1)
            self.pending.append((upcoming, answer))
            self.requests.put((upcoming, answer))
        return found, waited

    def close(self) -> None:
        """Stop the worker after the call it is on, the calls still queued dropped, and wait for it: a
        daemon thread still inside the processor's or a task's native code when the interpreter exits
        is ended there, which aborts the process ("terminate called without an active exception",
        SIGABRT) after a run that finished."""
        self.closed.set()
        self.pending.clear()
        self.requests.put(None)
        self.thread.join()

    def _work(self) -> None:
        while (request := self.requests.get()) is not None and not self.closed.is_set():
            indices, answer = request
            answer.put(self.prepare(indices))

    def prepare(self, indices: list[int]) -> Prepared:
        """The examples at `indices` made and, when `encode`, encoded; any error kept, not raised."""
        started = time.perf_counter()
        prepared = Prepared(indices)
        try:
            prepared.examples = [make_example(self.task, idx, "train") for idx in indices]
            if self.encode:
                prepared.prompt = encode_prompts(self.processor, prepared.examples, torch.device("cpu"), self.limit)
        except Exception as error:  # noqa: BLE001 - the trainer draws these itself and meets it there
            prepared.error = error
        prepared.seconds = time.perf_counter() - started
        return prepared
