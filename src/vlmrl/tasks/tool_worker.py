"""The tool worker's former home: it lives in vlmrl/tools/worker.py now; this name stays for code that
imports it from here (the same `WORKER` object)."""

from vlmrl.tools.worker import WORKER, WorkerFailed, WorkerTimeout

__all__ = ["WORKER", "WorkerFailed", "WorkerTimeout"]
