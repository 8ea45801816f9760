"""The one exception type users see: a problem with their input, said in one line.

The CLI prints `error: <message>` and exits 2 for a `VlmrlError`; anything else is a bug in vlmrl
and keeps its traceback.
"""


class VlmrlError(Exception):
    """Bad user input (a missing folder, a config mistake, bad data): a clear one-line message."""
