"""The Python API: `vlmrl.train`, `vlmrl.sft` and `vlmrl.evaluate`, for a notebook or a script.

The runs of `vlmrl train`, `vlmrl sft` and `vlmrl eval`, with Python objects where they fit:

    import vlmrl
    result = vlmrl.train("configs/shapes_grpo_tiny.yaml", {"train.steps": 20}, rewards=[my_reward])
    result.run_dir, result.final_model, result.metrics["accuracy"]
    vlmrl.evaluate(result, "shapes", n=32).summary["accuracy"]

A config is a `Config`, a mapping (sections nested, dotted keys, or both), a YAML path or None (the
defaults); `overrides` (a mapping of dotted keys, or `key=value` strings as on the command line) go
on top. The config is built by `config.from_dict`, the function that builds the command line's, and
checked again where every run starts (config.check_config): the same bad config is the same one-line
VlmrlError here as `vlmrl train`'s exit 2. Python objects: `task=` a Task instance, `dataset=` a
`datasets.Dataset` or `DatasetDict` read by the `dataset` task (task.params still apply), `rewards=`
functions (top-level ones: their import path is saved) or names (docs/rewards.md). A run never
starts over in a folder that holds a run (safety/resume.py): `resume=True` continues it.
docs/python.md is the page.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrl.config import (
    Config,
    TaskConfig,
    from_dict,
    parse_override,
    read_yaml,
    set_dotted,
    to_dict,
    with_files_from,
)
from vlmrl.errors import VlmrlError, require
from vlmrl.evaluation.eval_settings import TAKEN_FROM_RUN, resolve_run_eval
from vlmrl.evaluation.evaluate import EvalSettings, run_eval
from vlmrl.tasks import Task
from vlmrl.tasks.base import build_params
from vlmrl.tasks.dataset import DatasetParams, DatasetTask
from vlmrl.training import sft as sft_loop
from vlmrl.training import trainer


@dataclass
class RunResult:
    """What `vlmrl.train` and `vlmrl.sft` return."""

    run_dir: Path
    """The run folder (config.yaml, metrics.jsonl, checkpoints/, final/)."""
    final_model: Path
    """The trained model's folder: `model.name_or_path` of the next run, the model of `vlmrl.evaluate`."""
    metrics: dict[str, Any]
    """The last row of metrics.jsonl (the last step's reward, accuracy, loss, eval/... ); {} if none."""
    config: Config
    """The config the run ran with, as checked."""


@dataclass
class EvalResult:
    """What `vlmrl.evaluate` returns."""

    summary: dict[str, Any]
    """The evaluation's numbers: task, n, accuracy, rewards, completion_tokens, pass_at_k, blind, ...
    (as `vlmrl eval` prints and writes them; evaluation/evaluate.py `summarize`)."""
    examples: list[dict[str, Any]]
    """One record per example: prompt, answer, the completion and its scores."""
    path: Path
    """The JSON file written (summary, settings and examples)."""


ConfigSource = Config | Mapping[str, Any] | str | Path | None
"""What a run's config may be given as."""


def train(config: ConfigSource = None, overrides: Mapping[str, Any] | Sequence[str] | None = None, *,
          task: Task | None = None, dataset: Any = None, rewards: Sequence[Any] | None = None) -> RunResult:
    """GRPO as `vlmrl train` runs it, from Python (see the module docstring for the arguments)."""
    config, task = run_inputs(config, overrides, task, dataset, rewards)
    return result_of(trainer.train(config, task), config)


def sft(config: ConfigSource = None, overrides: Mapping[str, Any] | Sequence[str] | None = None, *,
        task: Task | None = None, dataset: Any = None) -> RunResult:
    """The supervised warm start as `vlmrl sft` runs it, from Python (see the module docstring)."""
    config, task = run_inputs(config, overrides, task, dataset, None)
    return result_of(sft_loop.sft(config, task), config)


def evaluate(model: str | Path | RunResult, task: str | Task | Any = None, *, params: Mapping[str, Any] | None = None,
             split: str = "test", n: int = 64, settings: EvalSettings | None = None,
             out_dir: str | Path | None = None, rewards: Sequence[Any] | None = None) -> EvalResult:
    """`vlmrl eval` from Python: `model` a model folder, a run folder (or its final/, a checkpoint) or a
    RunResult (its final model); `task` a task name (built with `params`), a Task, a `datasets.Dataset` /
    `DatasetDict` (the `dataset` task, `params` its parameters), or None: the run's task and parameters.
    `settings` default to EvalSettings(): greedy accuracy and the reward means; `EvalSettings(k=8,
    blind_check=True)` adds what `vlmrl eval` adds by default. A model of a run takes the run's rewards,
    max_new_tokens, tools and decode path (eval_settings.TAKEN_FROM_RUN) where `settings` leave them at
    their defaults and `rewards` (as a config's list) is not given. Writes the JSON where `vlmrl eval`
    does (out_dir/eval.json, else beside the model)."""
    folder = model.final_model if isinstance(model, RunResult) else model
    default = EvalSettings()
    given = {name: getattr(settings, name) for name in TAKEN_FROM_RUN  # the fields `settings` set
             if settings is not None and getattr(settings, name) != getattr(default, name)}
    if rewards is not None:
        given["rewards"] = list(rewards)
    params = dict(params or {})
    if task is not None and not isinstance(task, (str, Task)):
        task = dataset_task(task, params, seed=params.pop("seed", 0))
    elif isinstance(task, Task):
        require((not params, "give a Task's parameters when building it, or give its name with params="))
    run = resolve_run_eval(folder, task, params, given)
    evaluation, path = run_eval(run.model, run.task, run.params, split=split, n=n,
                                settings=dataclasses.replace(settings or EvalSettings(), **run.values),
                                out_dir=None if out_dir is None else str(out_dir))
    return EvalResult(summary=evaluation.results, examples=evaluation.records, path=Path(path))


# --------------------------------------------------------------------------- the inputs of a run


def run_inputs(config: ConfigSource, overrides: Mapping[str, Any] | Sequence[str] | None, task: Task | None,
               dataset: Any, rewards: Sequence[Any] | None) -> tuple[Config, Task | None]:
    """The run's checked config and its Python-built task (None: the config's task)."""
    data = config_data(config)
    for key, value in override_items(overrides):
        set_dotted(data, key, value)
    if rewards is not None:
        data["rewards"] = list(rewards)
    if dataset is not None:
        require((task is None, "give task= (a Task) or dataset= (its data), not both"))
        set_dotted(data, "task.name", DatasetTask.name)
    built = from_dict(Config, data)  # the command line's builder: its checks, its messages
    if dataset is not None:
        return built, dataset_task(dataset, built.task.params, built.seed)
    if task is not None:
        return with_task(built, task), task
    return built, None


def config_data(config: ConfigSource) -> dict[str, Any]:
    """A config source as the nested mapping `from_dict` builds from (the caller's left untouched)."""
    if config is None:
        return {}
    if isinstance(config, Config):
        return to_dict(config)
    if isinstance(config, (str, Path)):
        return with_files_from(read_yaml(config), Path(config).parent)
    if not isinstance(config, Mapping):
        raise VlmrlError(f"a config is a vlmrl Config, a mapping, a YAML path or None; got {type(config).__name__}")
    data: dict[str, Any] = {}
    for key, value in config.items():  # sections first, then the dotted keys on top of them
        if "." not in str(key):
            data[key] = copied(value)
    for key, value in config.items():
        if "." in str(key):
            set_dotted(data, key, copied(value))
    return data


def copied(value: Any) -> Any:
    """Mappings copied all the way down (set_dotted writes into them); other values as they are."""
    return {key: copied(item) for key, item in value.items()} if isinstance(value, Mapping) else value


def override_items(overrides: Mapping[str, Any] | Sequence[str] | None) -> list[tuple[str, Any]]:
    """(dotted key, value) of each override: a mapping's items, or `key=value` texts read as the
    command line reads them."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [(str(key), copied(value)) for key, value in overrides.items()]
    if isinstance(overrides, str):
        raise VlmrlError(f"overrides is a mapping or a list of key=value texts; got the text {overrides!r}")
    return [parse_override(item) for item in overrides]


def dataset_task(data: Any, params: Mapping[str, Any], seed: int) -> DatasetTask:
    """The `dataset` task reading `data` (a datasets.Dataset or DatasetDict) with parameters `params`."""
    built = build_params(DatasetParams, {**params, "seed": seed}, task=DatasetTask.name)
    return DatasetTask(built, data=data)


def with_task(config: Config, task: Task) -> Config:
    """`config` naming `task` (its name and the parameters that differ from their defaults, as
    config.yaml records them); its seed must be the run's."""
    require((isinstance(task, Task), f"task= must be a vlmrl.tasks.Task (a name goes in task.name); got {task!r}"),
            (task.params.seed == config.seed,
             f"the task's seed {task.params.seed} is not the run's seed {config.seed}: build it with "
             f"seed={config.seed}, or set the config's seed to {task.params.seed}"))
    default = task.Params()
    params = {f.name: plain(getattr(task.params, f.name)) for f in dataclasses.fields(task.params)
              if f.name != "seed" and getattr(task.params, f.name) != getattr(default, f.name)}
    return dataclasses.replace(config, task=TaskConfig(name=task.name, params=params))


def plain(value: Any) -> Any:
    """A parameter value as YAML writes it (tuples as lists)."""
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    return value


def result_of(run_dir: Path, config: Config) -> RunResult:
    """The RunResult of a finished run in `run_dir`."""
    run_dir = Path(run_dir)
    return RunResult(run_dir=run_dir, final_model=run_dir / "final", metrics=last_metrics(run_dir), config=config)


def last_metrics(run_dir: Path) -> dict[str, Any]:
    """The last row of run_dir/metrics.jsonl ({} when it has none)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    rows = [line for line in lines if line.strip()]
    return json.loads(rows[-1]) if rows else {}


__all__ = ["EvalResult", "RunResult", "evaluate", "sft", "train"]
