"""Alarms: the failure signs a person watching a GRPO run looks for, raised as they appear.

Each step's metrics go through `Alarms.check`; an alarm fires when its condition becomes true (not
again while it stays true) and comes back as a line for the terminal and a row for alarms.jsonl
(step, kind, message), which `vlmrl report` shows on the charts. The kinds:

- kl_spike:        KL above `kl_factor` x the running median of the last `window` steps' KL
                   (and above `kl_floor`, so noise around 0 is quiet);
- reward_collapse: mean reward of the last `short` steps below `collapse_ratio` of the best such
                   mean so far, by more than `collapse_margin` in absolute terms;
- reward_hacking:  a format reward ("reward/format") of at least 0.9 while accuracy stays at most
                   0.05, both averaged over the last `short` steps;
- no_signal:       most groups zero-variance (share above `no_signal_share` over `short` steps):
                   equal rewards in a group give no gradient;
- length_limit:    more than `truncated_share` of completions cut at max_new_tokens (`short` steps);
- sampler_mismatch: the sampler's log-probs far from the training pass's: KL(sampler || training)
                   above `mismatch_kl` (bf16 and compiled decoding: not yet measured on a GPU), or more than
                   `tis_capped_share` of tokens at the TIS cap (with rollout.ahead=1 the lag adds to it,
                   and the message says so).

Only the main process checks; no torch here.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from vlmrl.report.tracking import read_log

@dataclass(frozen=True)
class AlarmSettings:
    """Thresholds of the alarms (see the module docstring)."""

    window: int = 20
    short: int = 5
    kl_factor: float = 100.0
    kl_floor: float = 1e-3
    collapse_ratio: float = 0.5
    collapse_margin: float = 0.1
    no_signal_share: float = 0.8
    truncated_share: float = 0.5
    mismatch_kl: float = 0.01
    tis_capped_share: float = 0.01


class Alarms:
    """Watches step metrics; `check` returns the alarms that fired at this step."""

    def __init__(self, path: Path | None = None, settings: AlarmSettings = AlarmSettings(),
                 resume_step: int | None = None):
        """Alarms go to `path` (JSONL): emptied on a fresh run, cut back to `resume_step` on resume."""
        self.path = Path(path) if path is not None else None
        if self.path is not None and self.path.exists():
            rows = read_log(self.path) if resume_step is not None else []  # a torn line: dropped, with a warning
            kept = [row for row in rows if (row.get("step") or 0) <= resume_step]
            self.path.write_text("".join(json.dumps(row) + "\n" for row in kept))
        self.settings = settings
        self.history: dict[str, deque] = {}
        self.best_reward = -math.inf
        self.active: set[str] = set()

    def _recent(self, name: str, value: float | None, length: int) -> list[float]:
        values = self.history.setdefault(name, deque(maxlen=length))
        if value is not None and math.isfinite(value):
            values.append(float(value))
        return list(values)

    def conditions(self, metrics: dict) -> dict[str, str]:
        """Every alarm whose condition holds at this step, with its message."""
        s = self.settings
        found: dict[str, str] = {}
        kl = metrics.get("kl")
        past_kl = list(self.history.get("kl", []))
        if kl is not None and len(past_kl) >= s.short:
            median = statistics.median(past_kl)
            if kl > s.kl_floor and kl > s.kl_factor * max(median, 1e-12):
                found["kl_spike"] = f"KL {kl:.3g} is {kl / max(median, 1e-12):.0f}x its running median {median:.3g}"
        self._recent("kl", kl, s.window)

        rewards = self._recent("reward", metrics.get("reward"), s.short)
        if len(rewards) == s.short:
            mean = sum(rewards) / s.short
            if (self.best_reward > -math.inf and mean < s.collapse_ratio * self.best_reward
                    and self.best_reward - mean > s.collapse_margin):
                found["reward_collapse"] = (f"mean reward of the last {s.short} steps {mean:.3f} fell below "
                                            f"{s.collapse_ratio:.0%} of its best {self.best_reward:.3f}")
            self.best_reward = max(self.best_reward, mean)

        formats = self._recent("format", metrics.get("reward/format"), s.short)
        accuracy = self._recent("accuracy", metrics.get("accuracy"), s.short)
        if len(formats) == s.short and len(accuracy) == s.short:
            if sum(formats) / s.short >= 0.9 and sum(accuracy) / s.short <= 0.05:
                found["reward_hacking"] = ("format reward is high while accuracy stays near zero: read the "
                                           "completions (rollouts/) before trusting the reward")

        drawn = metrics.get("groups_drawn")
        share = None if not drawn else 1.0 - metrics.get("groups_with_signal", 0) / drawn
        no_signal = self._recent("no_signal", share, s.short)
        if len(no_signal) == s.short and min(no_signal) > s.no_signal_share:
            found["no_signal"] = (f"over {min(no_signal):.0%} of groups have equal rewards: little learning "
                                  "signal (try dynamic sampling, a larger group or an easier task)")

        truncated = self._recent("truncated", metrics.get("truncated"), s.short)
        if len(truncated) == s.short and min(truncated) > s.truncated_share:
            found["length_limit"] = (f"over {min(truncated):.0%} of completions hit max_new_tokens: raise "
                                     "rollout.max_new_tokens or add overlong shaping")

        mismatch, capped = metrics.get("mismatch_kl") or 0.0, metrics.get("tis_capped_fraction") or 0.0
        if mismatch > s.mismatch_kl or capped > s.tis_capped_share:
            cause = ("the rollouts were made with the weights of the step before (rollout.ahead=1): a lower "
                     "train.lr, or rollout.ahead=0, shrinks it" if metrics.get("rollout/lag_steps")
                     else "check rollout.decode and the dtype")
            found["sampler_mismatch"] = (f"the sampler's log-probs differ from the training pass's (KL {mismatch:.3g}, "
                                         f"{capped:.1%} of tokens at the TIS cap): {cause}; importance sampling "
                                         "corrects only a small mismatch")
        return found

    def check(self, metrics: dict) -> list[dict]:
        """Alarms that start at this step: {"step", "kind", "message"} each, appended to the file."""
        found = self.conditions(metrics)
        fired = [{"step": metrics.get("step"), "kind": kind, "message": message}
                 for kind, message in found.items() if kind not in self.active]
        self.active = set(found)
        if fired and self.path is not None:
            with self.path.open("a") as f:
                f.writelines(json.dumps(row) + "\n" for row in fired)
        return fired
