"""A reward of the run: its name, its function and weight, resolved from a config entry.

`build_rewards(entries, task)` turns the `rewards` list of the config into `Reward`s: a built-in by
name (builtin.py), `task` (the task's own `score()`, through `task_reward`), `package.module:function`
or `path/to/file.py:function` (imports.py), an `http(s)://` reward service (http.py), or `judge`: a
chat model that grades each completion (judge.py). An empty list
is `[task]`: the task's own score, as before there was a list. Every function is then called the way
TRL calls its reward functions (score.py): once per batch, with the keywords of PASSED and every
column of the data, each a list with one item per completion, and gives back one value per completion.

A function of your own runs in the reward worker, or contained in this process, within its
`timeout_s` (contain.py).

`check_arguments` refuses, before any model loads, a function that needs an argument that is neither a
keyword vlmrl passes nor a column of the data, or that is given a `kwargs` entry it does not take.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from vlmrl.errors import VlmrlError
from vlmrl.fields import closest
from vlmrl.imports import is_import_spec
from vlmrl.rewards.builtin import BUILTIN, completion_text
from vlmrl.rewards.contain import TIMEOUT_S, InWorker, contained
from vlmrl.rewards.http import http_reward, is_url
from vlmrl.rewards.judge import JUDGE, is_judge, judge_reward
from vlmrl.urls import host, redact

PASSED = ("prompts", "completions", "completion_ids", "answer", "images", "examples", "trajectories")
"""The keywords vlmrl passes every reward (besides the data's columns), each a list per completion:
the prompt as a conversation, the completion as one (TRL's conversational form), its token ids, the
gold answer, the example's images, the `Example` itself and the tool trajectory (None without tools)."""

TASK = "task"
"""The name of the reward that is the task's own `score()`."""
HERE, IN_WORKER, SERVICE = "here", "in_worker", "service"
"""Where a reward's call runs (`Reward.runs`): in the trainer's own thread (a built-in, `task`, a function
of your own contained in the process: contain.py), in the reward worker's process (a function of your
own found by name), or in a service over HTTP (a URL, the judge). The last two may be called from a
background thread while the next generate call runs (training/background_scoring.py)."""


@dataclass(frozen=True)
class Reward:
    """One reward: logged under `name`, weighted by `weight` in the total."""

    name: str
    fn: Callable[..., Any]  # fn(**keywords) -> one float / None / dict (with "total") per completion
    weight: float = 1.0
    takes: frozenset[str] | None = None  # the keywords fn takes; None: any (it has **kwargs)
    needs: tuple[str, ...] = ()  # its parameters without a default (kwargs bound excluded)
    spec: str = ""  # as the config named it
    of_task: bool = False  # the task's own score (its dict's other keys are logged under their own names)
    bound: frozenset[str] = frozenset()  # the config's kwargs, bound already: a column of that name is not passed
    runs: str = HERE  # where a call runs: HERE, IN_WORKER or SERVICE (what may score beside generation)

    def keywords(self, available: Mapping[str, Any]) -> dict[str, Any]:
        """The keywords of `available` this reward takes."""
        return {k: v for k, v in available.items()
                if k not in self.bound and (self.takes is None or k in self.takes)}


def task_reward(task) -> Callable[..., list[dict[str, float]]]:
    """The task's own score as a batched reward: `task.score(example, text)` per completion, or
    `task.score_trajectory(example, trajectory)` for a tool rollout; each a dict with "total"."""
    def score(examples, completions, trajectories):
        return [task.score(example, completion_text(completion)) if trajectory is None
                else task.score_trajectory(example, trajectory)
                for example, completion, trajectory in zip(examples, completions, trajectories)]
    score.__name__ = TASK
    return score


def _signature(fn: Callable[..., Any], spec: str) -> tuple[frozenset[str] | None, tuple[str, ...]]:
    """(the keywords `fn` takes, None with **kwargs; the ones it needs: no default)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None, ()  # no signature to read: trust it
    positional_only = [p.name for p in parameters if p.kind is p.POSITIONAL_ONLY]
    if positional_only:
        raise VlmrlError(f"reward {spec!r} is called with keywords only; its parameters {positional_only} "
                         "are positional-only")
    takes = None if any(p.kind is p.VAR_KEYWORD for p in parameters) else frozenset(
        p.name for p in parameters if p.kind is not p.VAR_POSITIONAL)
    needs = tuple(p.name for p in parameters
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty)
    return takes, needs


def _function(spec: str, task, timeout_s: float | None) -> tuple[str, Callable[..., Any]]:
    """(the default name, the function) of a built-in, `task` or an import path (contained: contain.py)."""
    if timeout_s is not None and not is_import_spec(spec):
        raise VlmrlError(f"reward {spec!r} takes no timeout_s: only a function of your own is timed (a built-in or "
                         "task runs untimed, a service has its own kwargs: timeout_s)")
    if spec == TASK:
        if task is None:
            raise VlmrlError("reward 'task' is the task's own score, and there is no task here")
        return TASK, task_reward(task)
    if spec in BUILTIN:
        return spec, BUILTIN[spec]
    if is_import_spec(spec):
        return contained(spec, timeout_s or TIMEOUT_S)
    close = closest(spec, [*BUILTIN, TASK, JUDGE])
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise VlmrlError(f"unknown reward {spec!r}; {hint}built-in: {', '.join([*BUILTIN, TASK, JUDGE])}; or your own as "
                     "package.module:function, path/to/file.py:function or an http(s):// URL")


def resolve(spec: str, weight: float = 1.0, kwargs: Mapping[str, Any] | None = None, label: str = "",
            task=None, timeout_s: float | None = None) -> Reward:
    """The Reward of one entry: `spec` (a name, import path or URL), its weight, the keyword arguments
    bound to it, the name it is logged under (default: the built-in's or the function's) and the time
    limit of a function of your own (None: contain.TIMEOUT_S)."""
    kwargs = dict(kwargs or {})
    if (is_url(spec) or is_judge(spec)) and timeout_s is not None:
        _function(spec, task, timeout_s)  # refused: a service's time limit is in its kwargs
    if is_url(spec):  # a service, logged under its host (never its userinfo), shown redacted; kwargs: its settings
        return Reward(label or host(spec), http_reward(spec, kwargs), weight, None, (), redact(spec), runs=SERVICE)
    if is_judge(spec):  # kwargs: its settings (judge.py); shown with its URL redacted
        fn, takes = judge_reward(kwargs)
        return Reward(label or JUDGE, fn, weight, takes, (), f"judge {redact(kwargs['url'])}", runs=SERVICE)
    name, fn = _function(spec, task, timeout_s)
    takes, needs = _signature(fn, spec)
    unknown = sorted(set(kwargs) - takes) if takes is not None else []
    if unknown:
        raise VlmrlError(f"reward {spec!r} takes no argument {', '.join(unknown)} (kwargs); it takes "
                         f"{', '.join(sorted(takes)) or 'nothing'}")
    bound = functools.partial(fn, **kwargs) if kwargs else fn
    said = f"the score() of task {task.name!r}" if spec == TASK else spec
    return Reward(label or name, bound, weight, takes, tuple(n for n in needs if n not in kwargs), said, spec == TASK,
                  frozenset(kwargs), IN_WORKER if isinstance(fn, InWorker) else HERE)


def build_rewards(entries: Iterable, task=None) -> list[Reward]:
    """The Rewards of the config's `rewards` entries (objects with name, weight, kwargs, label); none:
    the task's own score. Two rewards logged under one name are refused."""
    entries = list(entries)
    rewards = [resolve(e.name, e.weight, e.kwargs, e.label, task, getattr(e, "timeout_s", None))
               for e in entries] if entries else [
        resolve(TASK, task=task)]
    names = [r.name for r in rewards]
    if "total" in names:
        raise VlmrlError("a reward cannot be logged as 'total' (the combined reward's name); give it another label")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise VlmrlError(f"two rewards are logged as {', '.join(twice)}; give one a label (rewards: - name: ..., "
                         "label: ...)")
    return rewards


CORRECTNESS = ("accuracy", "math", "number", "choice", "exact")
"""The built-ins that measure correctness (1 right, 0 wrong): the first of them in a list is its accuracy
when no reward is logged as `accuracy`."""


def accuracy_source(rewards: list[Reward]) -> str | None:
    """The component that is accuracy: `accuracy` when a reward is logged under that name (the
    built-in, one labelled so, or the task's own score, whose dict holds it), else the first
    built-in of CORRECTNESS in the list; None when only other rewards (your own functions) are there."""
    if any(r.name == "accuracy" or r.of_task for r in rewards):
        return "accuracy"
    return next((r.name for r in rewards if r.spec in CORRECTNESS), None)


def evaluation_rewards(entries: Iterable, task) -> list[Reward]:
    """The rewards an evaluation scores with: the run's list (none: the task's own score), and, when no
    reward in it measures correctness (`accuracy_source`), the task's own score beside them with
    weight 0, whose accuracy is the evaluation's accuracy."""
    rewards = build_rewards(entries, task)
    if accuracy_source(rewards) is None:
        label = TASK if TASK not in [r.name for r in rewards] else "task_score"
        rewards.append(resolve(TASK, weight=0.0, label=label, task=task))
    return rewards


def check_arguments(rewards: list[Reward], columns: Iterable[str]) -> None:
    """VlmrlError when a reward needs an argument that is neither a keyword vlmrl passes nor a column."""
    available = set(PASSED) | set(columns)
    for reward in rewards:
        missing = [n for n in reward.needs if n not in available]
        if missing:
            data = ", ".join(sorted(set(columns))) or "no columns"
            raise VlmrlError(f"reward {reward.name!r} needs {', '.join(repr(m) for m in missing)}, which is neither a "
                             f"keyword vlmrl passes ({', '.join(PASSED)}) nor a column of the data (the data has "
                             f"{data})")


def describe(rewards: list[Reward], aggregation: str) -> str:
    """One line for the preflight: each reward with its weight and what it is, and the aggregation."""
    shown = [f"{r.name} x{r.weight:g}" + ("" if r.spec == r.name else f" ({r.spec})") for r in rewards]
    return f"{', '.join(shown)}; total = {'weighted sum' if aggregation == 'sum' else 'GDPO normalize_then_sum'}"
