"""How an evaluation runs: `EvalSettings`, the one place its defaults are written, and what an
evaluation of a run's model takes from the run's config (`resolve_run_eval`: its task, rewards and
generation settings, `TAKEN_FROM_RUN`, each given value winning).

Apart from `vlmrl.evaluation.evaluate` (which imports torch) so that the `vlmrl eval` flags can take their
defaults from these fields while `vlmrl --help` imports nothing heavy. `vlmrl.evaluation.evaluate` re-exports
it: `from vlmrl.evaluation.evaluate import EvalSettings` works as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmrl.config import (MAX_GROUP_SIZE, MAX_ROWS, MAX_TOKENS, MAX_TURNS, TOOL_IMAGE_SIDES, at_most, load_config,
                          reward_entry, temperature_rule, tool_image_side_rule)
from vlmrl.errors import VlmrlError, require, warn

MAX_LENGTH_BUCKETS = 100
"""Most completion-length buckets (quantiles of the greedy lengths): more than 100 leaves a handful of
examples, or none, in each."""


@dataclass
class EvalSettings:
    """How an evaluation runs. The defaults are the cheap ones for the trainer's periodic check
    (greedy accuracy only); `vlmrl eval` turns pass@k and the blind check on (`EVAL_CLI_DEFAULTS`
    in `vlmrl.cli`) and takes every other default from here."""

    batch_size: int = 32
    """Completions per generate call; pass@k puts max(1, batch_size // k) prompts in a call."""
    max_new_tokens: int = 128
    """Longest completion; longer ones are cut off (counted as truncated)."""
    k: int = 0
    """Sampled completions per example for pass@k; 0 skips sampling."""
    temperature: float = 1.0
    """Sampling temperature for pass@k."""
    top_p: float = 1.0
    """Nucleus sampling threshold for pass@k."""
    blind_check: bool = False
    """Also answer with a blank and with a shuffled image (two more greedy passes)."""
    length_buckets: int = 4
    """How many completion-length buckets (quantiles of the greedy lengths)."""
    seed: int = 0
    """Seeds the pass@k samples and the image shuffle."""
    tools: list[str] = field(default_factory=list)
    """Tools the model may call while answering (as rollout.tools: zoom, crop, module:function);
    [] = single-turn answers. The blind check blanks the images the tools read too."""
    tool_models: dict[str, str] = field(default_factory=dict)
    """Model tools' checkpoints, as rollout.tool_models ({detect: PATH})."""
    max_turns: int = 4
    """With tools: most model turns per answer."""
    max_trajectory_tokens: int = 1024
    """With tools: most tokens after the prompt per answer, tool results included."""
    tool_image_side: int = 448
    """With tools: longest side of an image a built-in tool returns (as rollout.tool_image_side)."""
    decode: str = "auto"
    """How generation decodes, as rollout.decode: auto, dynamic, static or compiled (decoding.py)."""
    rewards: list[Any] = field(default_factory=list)
    """The rewards answers are scored with, as the config's `rewards` list (names, {name, weight,
    kwargs, label} mappings or functions); [] = the task's own score. Accuracy is the reward that
    measures correctness: one logged as `accuracy`, else the first of math/number/choice/exact, else
    the task's own score's (rewards/reward.py `accuracy_source`)."""

    def __post_init__(self) -> None:
        self.rewards = [reward_entry(entry, f"rewards[{i}]") for i, entry in enumerate(self.rewards)]

    def validate(self) -> None:
        """Raise VlmrlError with a one-line message when a value is out of range."""
        checks = [(self.batch_size >= 1, f"batch size must be >= 1, got {self.batch_size}"),
                  (self.max_new_tokens >= 1, f"max new tokens must be >= 1, got {self.max_new_tokens}"),
                  (self.k >= 0, f"k must be >= 0 (0 skips pass@k), got {self.k}"),
                  temperature_rule("temperature", self.temperature, greedy=False),
                  (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
                  (self.length_buckets >= 1, f"length buckets must be >= 1, got {self.length_buckets}"),
                  (self.max_turns >= 1, f"max turns must be >= 1, got {self.max_turns}"),
                  (self.max_trajectory_tokens >= 1,
                   f"max trajectory tokens must be >= 1, got {self.max_trajectory_tokens}"),
                  (TOOL_IMAGE_SIDES[0] <= self.tool_image_side <= TOOL_IMAGE_SIDES[1],
                   tool_image_side_rule("--tool-image-side", self.tool_image_side)),
                  # the bounds of the run config's fields (config.py says why each)
                  at_most("batch size", self.batch_size, MAX_ROWS),
                  at_most("max new tokens", self.max_new_tokens, MAX_TOKENS),
                  at_most("k", self.k, MAX_GROUP_SIZE),
                  at_most("length buckets", self.length_buckets, MAX_LENGTH_BUCKETS),
                  at_most("max turns", self.max_turns, MAX_TURNS),
                  at_most("max trajectory tokens", self.max_trajectory_tokens, MAX_TOKENS)]
        require(*checks)


# ---------------------------------------------------------------- an evaluation of a run's model

RUN_CONFIGS = ("config.resumed.yaml", "config.yaml")
"""A run folder's configs, the latest first (safety/resume.py writes them)."""
TAKEN_FROM_RUN = ("max_new_tokens", "tools", "tool_models", "max_turns", "max_trajectory_tokens", "tool_image_side",
                  "decode", "rewards")
"""The EvalSettings fields an evaluation of a run's model takes from the run's config (`run_values`);
the task (name and parameters: data, template, system, verifier, ...) comes with them."""


@dataclass
class RunEval:
    """What an evaluation of `model` runs on: the model folder, the task, its parameters and the
    EvalSettings values given or taken from the run the model belongs to (`resolve_run_eval`)."""

    model: str
    """The model folder to load: a run folder's final/, else the path as given."""
    task: Any
    """A task name, or what the caller gave (a Task, a dataset)."""
    params: dict[str, Any]
    """The task's parameters."""
    values: dict[str, Any]
    """EvalSettings fields given or taken from the run (the others keep their defaults)."""
    config_file: Path | None = None
    """The run's config read, or None (the model is in no run folder)."""
    taken: list[str] = field(default_factory=list)
    """What was taken from the run: "task" and the names in TAKEN_FROM_RUN not given."""

    def line(self) -> str:
        """One line saying what came from the run ("" when nothing did): the task, the rewards, then the
        generation settings (the tool settings only with tools)."""
        if not self.taken:
            return ""
        with_tools = bool(self.values.get("tools"))
        parts = []
        for name in sorted(self.taken, key=["task", "rewards", *TAKEN_FROM_RUN].index):
            value = self.values.get(name)
            if name == "task":
                shown = ", ".join(f"{key}={value}" for key, value in self.params.items())
                parts.append(f"task {self.task}" + (f" ({shown})" if shown else ""))
            elif name == "rewards":
                parts.append("rewards " + (", ".join(r.label or r.name for r in value) or "the task's own score"))
            elif name == "tools":
                parts.append("tools " + (", ".join(value) or "none"))
            elif name == "tool_models":
                if with_tools and value:
                    parts.append("tool models " + ", ".join(f"{key} {path}" for key, path in value.items()))
            elif with_tools or name not in ("max_turns", "max_trajectory_tokens", "tool_image_side"):
                parts.append(f"{name} {value}")
        return f"from the run's {self.config_file}: model {self.model}; {'; '.join(parts)}"


def run_config_of(model: str | Path) -> tuple[Path, Path] | None:
    """(the run's latest config file, the model folder to load) when `model` is a run folder (its
    final/), a run's final/ or one of its checkpoints/step_* folders; else None."""
    path = Path(model).expanduser()
    for folder, model_dir in ((path, path / "final" if (path / "final").is_dir() else path),
                              (path.parent, path) if path.name == "final" else (None, None),
                              (path.parent.parent, path) if path.parent.name == "checkpoints" else (None, None)):
        if folder is None:
            continue
        found = next((folder / name for name in RUN_CONFIGS if (folder / name).is_file()), None)
        if found is not None:
            return found, model_dir
    return None


def run_values(config) -> dict[str, Any]:
    """The TAKEN_FROM_RUN fields of a run's `Config`: its held-out evaluation's length (eval.max_new_tokens,
    else rollout.max_new_tokens), its tools (and their models) and decode path as rollout.* sets them, and
    its rewards."""
    rollout = config.rollout
    return {"max_new_tokens": config.eval.max_new_tokens or rollout.max_new_tokens, "tools": list(rollout.tools),
            "tool_models": dict(rollout.tool_models),
            "max_turns": rollout.max_turns, "max_trajectory_tokens": rollout.max_trajectory_tokens,
            "tool_image_side": rollout.tool_image_side, "decode": rollout.decode, "rewards": list(config.rewards)}


def resolve_run_eval(model: str | Path, task: Any, params: dict[str, Any], given: dict[str, Any]) -> RunEval:
    """What an evaluation of `model` runs on: `task` (None: the run's), `params` (on top of the run's
    when the task is the run's, by name) and the EvalSettings values `given` win; the rest of
    TAKEN_FROM_RUN comes from the run `model` belongs to (`run_config_of`; none: nothing is taken).
    VlmrlError in one line when no task is given and there is no run (or no readable config) to take one
    from; a run's config that cannot be read while a task is given is a warning, and nothing is taken."""
    found = run_config_of(model)
    if found is None:
        require((task is not None, f"name a task (--task NAME): {str(model)!r} is not a vlmrl run folder, its final/ "
                                   "or one of its checkpoints, whose config would name one"))
        return RunEval(str(model), task, dict(params), dict(given))
    config_file, model_dir = found
    try:
        config = load_config(config_file)
    except VlmrlError as error:
        if task is None:
            raise VlmrlError(f"the run's {config_file} cannot be read ({error}): name the task (--task NAME) and its "
                             "settings") from error
        warn(f"the run's {config_file} cannot be read ({error}); nothing is taken from it")
        return RunEval(str(model_dir), task, dict(params), dict(given))
    run_params = {"seed": config.seed, **config.task.params}  # as the run built it (tasks/base.py run_task)
    taken = [name for name in TAKEN_FROM_RUN if name not in given]
    values = {name: value for name, value in run_values(config).items() if name in taken} | given
    if task is None:
        return RunEval(str(model_dir), config.task.name, run_params | dict(params), values, config_file,
                       ["task", *taken])
    if isinstance(task, str) and task == config.task.name:  # the run's task: its parameters, the given ones on top
        return RunEval(str(model_dir), task, run_params | dict(params), values, config_file, ["task", *taken])
    return RunEval(str(model_dir), task, dict(params), values, config_file, taken)
