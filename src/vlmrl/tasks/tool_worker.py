"""The worker process your own tools run in (tools.py): a `vlmrl.worker.Worker` of its own, which
imports the tools' module before it is ready. See vlmrl/worker.py for what a worker guarantees."""

from __future__ import annotations

from vlmrl.worker import Worker, WorkerFailed, WorkerTimeout

__all__ = ["WORKER", "WorkerFailed", "WorkerTimeout"]

WORKER = Worker("tool", ("vlmrl.tasks.tools",))
"""The process's tool worker, stopped when the process exits."""
