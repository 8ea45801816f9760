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
`datasets.Dataset` or `DatasetDict` read by the `dataset` task (task.params still apply; a path is
`task.params.path`), `rewards=` functions (top-level ones: their import path is saved), names, or
either with a weight, label and kwargs: `vlmrl.Reward(fn, weight=2, label="accuracy")` or
`{"name": fn, "weight": 2}` (docs/rewards.md). Every argument's type is checked when the call starts,
each in one line naming the argument, what was given and what it takes (`checked_*` below). A run
never starts over in a folder that holds a run (safety/resume.py): `resume=True` continues it.
docs/python.md is the page.
"""

from __future__ import annotations

import dataclasses
import json
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrl.config import (
    Config,
    RewardConfig,
    TaskConfig,
    from_dict,
    parse_override,
    read_yaml,
    reward_entry,
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
    config, task = run_inputs(config, overrides, task, dataset, checked_rewards(rewards, "vlmrl.train"))
    return result_of(trainer.train(config, task), config)


def sft(config: ConfigSource = None, overrides: Mapping[str, Any] | Sequence[str] | None = None, *,
        task: Task | None = None, dataset: Any = None) -> RunResult:
    """The supervised warm start as `vlmrl sft` runs it, from Python (see the module docstring)."""
    config, task = run_inputs(config, overrides, task, dataset, None, call="vlmrl.sft")
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
    does (out_dir/eval.json, else beside the model). Every argument is checked first (`checked_evaluation`)."""
    rewards = checked_rewards(rewards, "vlmrl.evaluate")
    checked_evaluation(model, task, params, split, n, settings, out_dir)
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
               dataset: Any, rewards: list[Any] | None, call: str = "vlmrl.train") -> tuple[Config, Task | None]:
    """The run's checked config and its Python-built task (None: the config's task). Each argument's
    type is checked first, in one line naming the argument (`call` is the API function)."""
    checked_task(task, dataset, call)
    dataset = checked_dataset(dataset, call)
    data = config_data(config, call)
    for key, value in override_items(overrides, call):
        set_dotted(data, key, value)
    if rewards is not None:
        data["rewards"] = list(rewards)
    if dataset is not None:
        set_dotted(data, "task.name", DatasetTask.name)
        if isinstance(dataset, (str, Path)):  # a file, a folder or a hub id: the task's path, saved with the run
            set_dotted(data, "task.params.path", str(dataset))
    built = from_dict(Config, data)  # the command line's builder: its checks, its messages
    if dataset is not None and not isinstance(dataset, (str, Path)):
        return built, dataset_task(dataset, built.task.params, built.seed)
    if task is not None:
        return with_task(built, task), task
    return built, None


def config_data(config: ConfigSource, call: str = "vlmrl.train") -> dict[str, Any]:
    """A config source as the nested mapping `from_dict` builds from (the caller's left untouched)."""
    if config is None:
        return {}
    if isinstance(config, Config):
        return to_dict(config)
    if isinstance(config, (str, Path)):
        return with_files_from(read_yaml(config), Path(config).parent)
    if not isinstance(config, Mapping):
        raise VlmrlError(f"{call}: config= takes a vlmrl Config, a mapping, a YAML file's path or None; got "
                         f"{given(config)}")
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


def override_items(overrides: Mapping[str, Any] | Sequence[str] | None, call: str = "vlmrl.train"
                   ) -> list[tuple[str, Any]]:
    """(dotted key, value) of each override: a mapping's items, or `key=value` texts read as the
    command line reads them."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [(str(key), copied(value)) for key, value in overrides.items()]
    accepted = "a mapping of dotted keys or a list of key=value texts"
    if isinstance(overrides, str) or not isinstance(overrides, (list, tuple)):
        raise VlmrlError(f"{call}: overrides= takes {accepted}; got {given(overrides)}")
    wrong = [item for item in overrides if not isinstance(item, str)]
    if wrong:
        raise VlmrlError(f"{call}: overrides= takes {accepted}; got a list holding {given(wrong[0])}")
    return [parse_override(item) for item in overrides]


# --------------------------------------------------------------------------- the arguments' types


def given(value: Any) -> str:
    """What a caller gave, in a few words: its type and a short repr (a DataFrame by its name)."""
    kind = type(value)
    if kind.__module__.split(".")[0] == "pandas":
        return f"a pandas {kind.__name__}"
    if isinstance(value, str):
        return f"the text {reprlib.repr(value)}"
    return f"{kind.__name__} {reprlib.repr(value)}"


def table_hint(value: Any) -> str:
    """How rows held in another form become a `datasets.Dataset` ("" when none is known)."""
    kind = type(value)
    if kind.__module__.split(".")[0] == "pandas" and kind.__name__ == "DataFrame":
        return ": give datasets.Dataset.from_pandas(df)"
    if isinstance(value, (list, tuple)) and all(isinstance(row, Mapping) for row in value):
        return ": give datasets.Dataset.from_list(rows)"
    if isinstance(value, Mapping):
        return ": give datasets.Dataset.from_dict(columns)"
    return ""


def is_dataset(value: Any) -> bool:
    """A `datasets.Dataset` or `DatasetDict` (the datasets library imported only if it already is)."""
    import datasets

    return isinstance(value, (datasets.Dataset, datasets.DatasetDict))


def checked_dataset(dataset: Any, call: str) -> Any:
    """`dataset=` as given when it is a datasets object, a path (a file, a folder, a hub id) or None;
    else VlmrlError naming what it is and, for rows in another form, how to make it a Dataset."""
    if dataset is None or isinstance(dataset, (str, Path)) or is_dataset(dataset):
        return dataset
    raise VlmrlError(f"{call}: dataset= takes a datasets.Dataset or DatasetDict, or the path of a data file or "
                     f"folder; got {given(dataset)}{table_hint(dataset)}")


def checked_task(task: Any, dataset: Any, call: str) -> None:
    """`task=` is a Task or None, and not given beside `dataset=`."""
    require((dataset is None or task is None, f"{call}: give task= (a Task) or dataset= (its data), not both"))
    if task is None or isinstance(task, Task):
        return
    hint = (" (a task's name goes in the config: task.name)" if isinstance(task, str) else
            " (data goes in dataset=)" if is_dataset(task) or table_hint(task) else "")
    raise VlmrlError(f"{call}: task= takes a vlmrl.tasks.Task{hint}; got {given(task)}")


def checked_rewards(rewards: Any, call: str) -> list[Any] | None:
    """`rewards=` as a list: a list or tuple as it is, one reward alone (a name, a function, a mapping
    or a vlmrl.Reward) as a list of one, a text as the config reads it (`"accuracy,format"`), None as
    None; each entry is then read and checked (config.reward_entry), all before the run starts."""
    if rewards is None:
        return None
    if isinstance(rewards, str):
        rewards = [name.strip() for name in rewards.split(",") if name.strip()]
    elif isinstance(rewards, (Mapping, RewardConfig)) or callable(rewards):
        rewards = [rewards]
    elif not isinstance(rewards, (list, tuple)):
        raise VlmrlError(f"{call}: rewards= takes a list of rewards (names, functions, {{name, weight, label, "
                         f"kwargs}} mappings, vlmrl.Reward) or one of them; got {given(rewards)}")
    return [reward_entry(entry, f"rewards[{i}]") for i, entry in enumerate(rewards)]


def checked_evaluation(model: Any, task: Any, params: Any, split: Any, n: Any, settings: Any, out_dir: Any) -> None:
    """The types of `vlmrl.evaluate`'s arguments, each refused in one line naming it."""
    call = "vlmrl.evaluate"
    rows = table_hint(task) if not isinstance(task, str) else ""
    checks = [
        (isinstance(model, (str, Path, RunResult)), f"model= takes a model or run folder (a path or hub id) or a RunResult; "
                                                    f"got {given(model)}"),
        (task is None or isinstance(task, (str, Task)) or is_dataset(task),
         f"task= takes a task's name, a Task, a datasets.Dataset or DatasetDict, or None (the run's task); "
         f"got {given(task)}{rows}"),
        (params is None or isinstance(params, Mapping), f"params= takes a mapping of task parameters; got "
                                                        f"{given(params)}"),
        (isinstance(split, str), f"split= takes a split's name (train, test, ...); got {given(split)}"),
        (isinstance(n, int) and not isinstance(n, bool) and n >= 1, f"n= takes a whole number >= 1; got {given(n)}"),
        (settings is None or isinstance(settings, EvalSettings), f"settings= takes an EvalSettings; got "
                                                                 f"{given(settings)}"),
        (out_dir is None or isinstance(out_dir, (str, Path)), f"out_dir= takes a folder's path; got {given(out_dir)}"),
    ]
    require(*[(ok, f"{call}: {message}") for ok, message in checks])


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
