"""Checkpoints written on a background thread, one at a time (`train.background_checkpoints`).

At a step's end the trainer copies what the checkpoint holds to host memory (checkpoint.host_copy:
weights, optimizer moments, scheduler, RNG, the reference copy) and hands the writing to this
thread; training goes on while it writes. A checkpoint is whole and durable (fsynced, renamed into
place: checkpoint.write_checkpoint) before the next one starts (`start` waits for the one before)
and before the run ends (`wait`, from the session's finish and close), and a kill while it writes
leaves the previous checkpoint as it was and a `.tmp_step_*` folder that the next save clears. A
failure of the write (a full disk: one line) is kept and raised in the trainer at the next step's
end (`check`), at the next save or at the end of the run (`wait`), whichever comes first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class CheckpointWriter:
    """The background thread of one checkpoint at a time, and the failure of the last one."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self.seconds: float | None = None  # a finished write's wall time on the thread, until `take_seconds`

    def start(self, write: Callable[[], object]) -> None:
        """Wait for the checkpoint being written (raising its failure), then run `write()` on a new
        thread. The thread is not a daemon: a run that ends in an error still finishes the write."""
        self.wait()
        self.thread = threading.Thread(target=self._run, args=(write,), name="vlmrl-checkpoint")
        self.thread.start()

    def _run(self, write: Callable[[], object]) -> None:
        started = time.perf_counter()
        try:
            write()
        except BaseException as error:  # noqa: BLE001 - raised in the trainer (`check`, `wait`)
            self.failure = error
        self.seconds = time.perf_counter() - started

    def take_seconds(self) -> float | None:
        """The wall time of the last write, once it has finished (then None until the next one's)."""
        if self.busy:
            return None
        seconds, self.seconds = self.seconds, None
        return seconds

    @property
    def busy(self) -> bool:
        """Whether a checkpoint is being written now."""
        return self.thread is not None and self.thread.is_alive()

    def check(self) -> None:
        """Raise the failure of a write that has ended (once); nothing while one is being written."""
        if not self.busy:
            self._raise()

    def wait(self) -> None:
        """Wait until the checkpoint being written is whole on disk; raise its failure (once)."""
        if self.thread is not None:
            self.thread.join()
        self._raise()

    def _raise(self) -> None:
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure
