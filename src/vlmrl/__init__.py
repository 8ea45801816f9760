"""vlmrl: teach vision-language models to reason about images with reinforcement learning.

GRPO and its variants (DAPO, Dr. GRPO, GSPO) on any Hugging Face image-text-to-text model, with
procedural visual reasoning tasks whose rewards resist hacking. See README.md and the `vlmrl` command.

From Python (docs/python.md): `vlmrl.train(config, ...)`, `vlmrl.sft(config, ...)` and
`vlmrl.evaluate(model, task, ...)` with `vlmrl.EvalSettings`, imported on first use (vlmrl/training/api.py), so that
`import vlmrl` and `vlmrl --help` load no torch; `vlmrl.Reward(fn, weight=, label=, kwargs=)`, an entry
of a `rewards` list (the config's RewardConfig: a function given a weight, a label or arguments).
"""

import importlib

__version__ = "0.1.0"

PYTHON_API = ("train", "sft", "evaluate", "RunResult", "EvalResult")
"""The names of vlmrl/training/api.py that `vlmrl` itself offers."""
ELSEWHERE = {"EvalSettings": "vlmrl.evaluation.eval_settings"}
"""Other names `vlmrl` offers, and the module each is imported from on first use (no torch for these)."""

CONFIG_NAMES = {"Reward": "RewardConfig"}
"""The names `vlmrl` offers from vlmrl/config.py (no torch): public name -> the name there."""

__all__ = [*PYTHON_API, *ELSEWHERE, *CONFIG_NAMES, "__version__"]


def __getattr__(name: str):
    """`vlmrl.train` and the other names of PYTHON_API, imported when first asked for, by name: the
    modules that read `vlmrl.__version__` (report/) do not import the training stage through it."""
    if name in PYTHON_API:
        return getattr(importlib.import_module("vlmrl.training.api"), name)
    if name in ELSEWHERE:
        return getattr(importlib.import_module(ELSEWHERE[name]), name)
    if name in CONFIG_NAMES:
        return getattr(importlib.import_module("vlmrl.config"), CONFIG_NAMES[name])
    raise AttributeError(f"module 'vlmrl' has no attribute {name!r}")
