"""What users see when something is wrong: one exception type, a stop by signal, and warnings.

The CLI prints `error: <message>` and exits 2 for a `VlmrlError`; anything else is a bug in vlmrl
and keeps its traceback. A run stopped by SIGINT or SIGTERM (after saving a checkpoint) ends in
`Interrupted`, a study stopped by one (after its runs saved theirs) in `Stopped`: the CLI prints
`interrupted: <message>` and exits with status 128 + the signal number.
"""

from __future__ import annotations

import signal
import sys


class VlmrlError(Exception):
    """Bad user input (a missing folder, a config mistake, bad data): a clear one-line message."""


def one_line(error: BaseException | str) -> str:
    """Another library's error message, whole, on one line (its lines joined, whitespace collapsed;
    an empty message gives the error's type): cutting it at its first line left "... from one of:"
    with nothing after."""
    text = " ".join(str(error).split())
    return text or (type(error).__name__ if isinstance(error, BaseException) else "")


def require(*rules: tuple[bool, str]) -> None:
    """VlmrlError with the message of the first rule whose condition is false."""
    for ok, message in rules:
        if not ok:
            raise VlmrlError(message)


class Stopped(Exception):
    """Stopped at a signal, with what was done saved (the message says how to continue);
    `exit_code` is 128 + the signal."""

    def __init__(self, signum: int, message: str):
        self.signum, self.exit_code = signum, 128 + signum
        super().__init__(message)


class Interrupted(Stopped):
    """The run stopped at a signal after saving a checkpoint."""

    def __init__(self, signum: int, step: int, checkpoint):
        self.step, self.checkpoint = step, checkpoint
        super().__init__(signum, f"{signal.Signals(signum).name} received: stopped after step {step} with a "
                                 f"checkpoint in {checkpoint}; continue with resume=true")


def warn(message: str) -> None:
    """One line on stderr, `warning: <message>`: something the user should know, not a failure."""
    print(f"warning: {message}", file=sys.stderr, flush=True)
