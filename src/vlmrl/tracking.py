"""Where metrics go: `metrics.jsonl` in the run directory, one JSON object per step.

On resume the file is cut back to the checkpoint's step, so a resumed run's log reads exactly like
an uninterrupted one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLog:
    """Append-only JSONL of per-step metrics."""

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, metrics: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")


def read_metrics(path: Path) -> list[dict]:
    """All rows of a metrics.jsonl."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
