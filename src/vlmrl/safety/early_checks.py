"""The checks a run makes before it loads anything: the config against the world it will run in.

Each config field checks its own range and the sections their rules between each other when the
config is built (config.py). What needs more than the config is checked here, before the model
loads, so that a mistake costs a second and one `error:` line rather than a model load (or a step):
- the batch layout over the processes `accelerate launch` starts (WORLD_SIZE);
- the task: its name and parameters (a dataset that is missing or malformed), and the splits that
  evaluation asks for; `train.epochs` made into `train.steps` from its train rows (`epoch_steps`);
- the `rewards` (of a train run; of an sft run too when its config names them, which its evaluations
  score with and a train run of the same config trains on): each one resolves, takes the arguments
  vlmrl passes and the data has, a task's own score gives a dict, and the gold answer scores 1 on
  each comparing built-in (rewards/checks.py), on the first train examples;
- `rollout.tools` (an unknown name, a module that does not import) and `train.trackers` (asked for,
  not installed);
- the run folder (`output_dir`): it, or the folder it will be made in, takes a new file (read-only: one line);
- the model: a local folder that does not exist, a hub id while offline, a model vlmrl cannot train
  (an encoder-decoder, remote code not allowed, not image-text-to-text, a processor that needs a
  missing package: model_source.py), a device this machine does not have (model.device=cuda without
  CUDA, which accelerate would run on the CPU), and a FlashAttention kernel without its package or a GPU;
- the distillation teacher (`algorithm.teacher`): missing, the policy itself, or another tokenizer or
  image-token layout than the policy's (teacher_check.py).
No torch imported here (transformers imports it once a model config is found). The checks that need the model (prompt lengths in its tokens, memory, disk space)
follow once it is loaded (preflight.py).
"""

from __future__ import annotations

import errno
import importlib.util
import math
import os
from pathlib import Path

from vlmrl.config import Config, TrainConfig, check_config
from vlmrl.disk import cannot_write, probe_writable
from vlmrl.errors import VlmrlError
from vlmrl.models.model_source import check_model_source
from vlmrl.models.teacher_check import check_teacher
from vlmrl.models.tool_models import check_tool_models
from vlmrl.report.tracking import check_trackers
from vlmrl.rewards.builtin import COMPARING
from vlmrl.rewards.checks import check_rewards, check_weights
from vlmrl.rewards.reward import build_rewards, evaluation_rewards
from vlmrl.tasks import Example, Task, run_task
from vlmrl.tools.registry import resolve_tools


def launched_world() -> int:
    """Processes of this run as the launcher set them (accelerate / torchrun: WORLD_SIZE), 1 alone."""
    try:
        return max(int(os.environ.get("WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
"""The package each FlashAttention kernel of transformers needs."""


def check_attention_kernel(kernel: str | None, device: str) -> None:
    """A FlashAttention kernel needs its package and a GPU."""
    package = FLASH_PACKAGES.get(kernel or "")
    if package is None:
        return
    if device == "cpu":
        raise VlmrlError(f"model.attn_implementation={kernel} needs a GPU; model.device is cpu (use sdpa)")
    if importlib.util.find_spec(package) is None:
        raise VlmrlError(f"model.attn_implementation={kernel} needs the {package} package, which is not installed "
                         "(install it, or use sdpa)")


REWARD_CHECK_EXAMPLES = 8
"""How many of the first train examples the gold answers are checked on before loading (one when no
built-in compares with the gold answer)."""


def first_examples(task: Task, count: int) -> list[Example]:
    """The first `count` train examples the task can make (a bad one is left to the row checks, bad_rows.py)."""
    examples = []
    for idx in range(count):
        try:
            examples.append(task.example(idx, "train"))
        except Exception:  # noqa: BLE001 - a bad example stops the run where on_bad_row says, not here
            continue
    return examples


def check_device(device: str) -> None:
    """model.device names a device this machine has (loading.resolve_device): accelerate would
    otherwise run a run that asked for cuda on the CPU, silently. Torch is imported only for a device
    other than auto or cpu."""
    if device not in ("auto", "cpu"):
        from vlmrl.models.loading import resolve_device

        resolve_device(device, "model.device")


def epoch_steps(config: Config, task: Task, mode: str) -> None:
    """train.epochs made into train.steps, set in `config` itself (the run, its checkpoints and
    evaluations count steps): ceil(epochs x the task's train rows / the prompts of a step). A task
    without a fixed set of train rows has no epochs, and a train.steps that says otherwise than the
    epochs (other than its default) is refused, each in one line."""
    epochs = config.train.epochs
    if not epochs:
        return
    size = getattr(task, "size", None)
    rows = size("train") if size is not None else None
    if not rows:
        raise VlmrlError(f"train.epochs={epochs:g} needs a task with a fixed set of train rows (the dataset task); "
                         f"task {task.name!r} makes a new example for every index: give train.steps instead")
    per_step = config.sft.batch_size if mode == "sft" else config.rollout.prompts_per_step
    steps = math.ceil(epochs * rows / per_step)
    if config.train.steps not in (TrainConfig.steps, steps):
        raise VlmrlError(f"train.steps={config.train.steps} and train.epochs={epochs:g} both set the run's length "
                         f"({epochs:g} epochs of {rows} train rows at {per_step} a step are {steps} steps): give one")
    config.train.steps = steps


def check_output_writable(output_dir: str) -> None:
    """VlmrlError in one line when the run could not write its folder: `output_dir`, or the nearest
    folder above it that exists when it is not made yet (nothing is created here), must take a new
    file (a probe made and removed): a read-only folder, or a file in the way, is said now."""
    folder = existing = Path(output_dir)
    while not existing.exists() and not existing.is_symlink() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(existing))
        probe_writable(existing)
    except OSError as error:
        raise cannot_write("the run", folder, error) from error


def check_before_loading(config: Config, mode: str, task: Task | None = None) -> Task:
    """VlmrlError (one line) for what would stop a `mode` ("train" or "sft") run once loaded; returns
    the run's task: `task` when given (a Task built in Python, vlmrl.training.api), else the config's.
    The config is checked first as the command line checks it (config.check_config), so a config
    built in Python is refused in the line `vlmrl train` prints."""
    check_config(config)
    check_model_source(config.model.name_or_path, config.model.trust_remote_code)  # the first thing a new user builds: said first
    check_output_writable(config.output_dir)
    world = launched_world()
    (config.rollout if mode == "train" else config.sft).check_layout(world)
    if task is None:
        task = run_task(config.task.name, config.seed, config.task.params)
    epoch_steps(config, task, mode)
    if config.eval.every > 0:
        for split in config.eval.splits:
            if split not in task.splits:
                raise VlmrlError(f"eval.splits names {split!r}, which task {task.name!r} does not have; "
                                 f"valid: {', '.join(task.splits)}")
    if mode == "train":
        rewards = build_rewards(config.rewards, task)
        gold = any(reward.spec in COMPARING for reward in rewards)  # the gold check reads several examples
        examples = first_examples(task, min(config.rollout.prompts_per_step, REWARD_CHECK_EXAMPLES) if gold else 1)
        check_rewards(rewards, task, examples)
        check_weights(rewards, bool(config.algorithm.teacher))
    elif config.rewards:  # sft evaluates with them, and a train run of this config trains on them: said now
        check_rewards(evaluation_rewards(config.rewards, task), task, first_examples(task, 1))
    if config.rollout.tools or config.rollout.tool_models:
        check_tool_models(resolve_tools(config.rollout.tools, config.rollout.tool_models))  # model tools' folders
    check_trackers(config.train.trackers)
    check_device(config.model.device)
    check_attention_kernel(config.model.attn_implementation, config.model.device)
    if mode == "train":
        check_teacher(config)
    return task
