"""The worker process your own tools run in (running.py): a `vlmrl.worker.Worker` of its own, which
imports the modules of its jobs (`call_tool` in running.py, `import_only` in registry.py) before it is
ready. See vlmrl/worker.py for what a worker guarantees."""

from __future__ import annotations

from vlmrl.worker import Worker, WorkerFailed, WorkerTimeout

__all__ = ["WORKER", "WorkerFailed", "WorkerTimeout"]

WORKER = Worker("tool", ("vlmrl.tools.running", "vlmrl.tools.registry"))
"""The process's tool worker, stopped when the process exits."""
