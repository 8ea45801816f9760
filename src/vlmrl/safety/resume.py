"""What `resume=true` may change: a resumed run continues the run its folder holds, not another one.

The run folder keeps the config the run started with in `config.yaml` (never rewritten by a
resume) and the config of its latest resume in `config.resumed.yaml`. On resume the new config is
compared with the latest of the two, key by key:
- a change that alters what the run is (the model, the task and its parameters, the algorithm, the
  batch layout, the optimizer and its schedule, LoRA, the seed: every key not in RESUME_MAY_CHANGE)
  stops the run before anything is loaded, in one line naming each key with its old and new value,
  unless `resume_changes=allow`: then the run goes on with a warning listing them;
- a change that does not (train.steps, eval.*, logging, checkpoints, speedups that compute the same
  thing, the device: RESUME_MAY_CHANGE) is allowed and listed in one line.
The data is checked too: a run on files (`task.name=dataset`, geometry's file presets) records their
fingerprint in `data.json` when it starts (vlmrl.data.fingerprint: each file's name, size and
hash; a hub dataset's or a Python object's `datasets` fingerprint), and a resume on data that differs
stops in one line naming each file that changed, unless `resume_changes=allow` (then a warning, and
data.json holds the new fingerprint).
A run with resume=false does not start over in a folder that holds a run's work (its final model, a
checkpoint or metrics rows: `check_fresh_start`): starting again there would mix two runs' metrics
and checkpoints. The command is checked too: each checkpoint records the command that saved it (`vlmrl train` or
`vlmrl sft`), and the other command does not continue it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from vlmrl.config import Config, saved_dict, to_dict
from vlmrl.data.fingerprint import differences
from vlmrl.errors import VlmrlError, warn

STARTED_CONFIG = "config.yaml"
"""The config the run started with, in its folder."""
RESUMED_CONFIG = "config.resumed.yaml"
"""The config of the run's latest resume, beside it."""
DATA_FINGERPRINT = "data.json"
"""The fingerprint of the data the run reads (of its latest resume), beside them."""

NOT_COMPARED = ("output_dir", "resume", "resume_changes")
"""Keys a resume sets by its nature."""

RESUME_MAY_CHANGE = (
    "task.params.on_bad_row", "task.params.check_images",
    "model.device", "model.attn_implementation", "model.trust_remote_code", "model.gradient_checkpointing",
    "rollout.share_prompt_cache", "rollout.decode", "rollout.max_prompt_length", "rollout.generation_batch_size",
    "rollout.tool_timeout_s", "rollout.fsdp_generation",
    "train.steps", "train.epochs", "train.max_bad_steps", "train.micro_batch_size", "train.pack_groups",
    "train.block_attention",
    "train.batched_vision_attention", "train.fused_kernels", "train.logprob_chunk", "train.save_every",
    "train.keep_checkpoints", "train.log_rollouts_every", "train.attention_every", "train.trackers",
    "train.tracker_project", "train.prefetch_batches", "train.background_checkpoints",
    "train.background_scoring", "train.background_logs", "eval.")
"""Keys (a trailing dot: a whole section) whose change leaves the run what it was: how long it goes,
what it evaluates and logs, how often it saves, exact speedups, where it runs, and what it does with
bad data (task.params.on_bad_row, check_images: a run stopped at a bad row resumes with
on_bad_row=skip, safety/bad_rows.py). Every other key changes its meaning, a key added to Config
too until it is listed here. train.micro_batch_size changes the update only when
algorithm.top_entropy_share < 1 (the share is taken within each micro-batch);
rollout.generation_batch_size changes which samples are drawn (each generate call is seeded from
its first prompt), not what is learnt."""


class _Unset:
    def __repr__(self) -> str:
        return "(unset)"


UNSET = _Unset()
"""A key one of two configs lacks (a task parameter, say), as the change lists it."""


def flatten(data: dict, prefix: str = "") -> dict:
    """{"train.lr": 1e-6, "task.params.max_words": 3, ...}: every leaf of a nested mapping."""
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def may_change(key: str, old: dict, new: dict) -> bool:
    """Whether changing `key` leaves the run what it was (`old`, `new`: the flat configs)."""
    if key == "train.micro_batch_size":  # the top-entropy share is taken within each micro-batch
        shares = [config.get("algorithm.top_entropy_share", 1.0) for config in (old, new)]
        return all(isinstance(share, (int, float)) and share >= 1 for share in shares)
    return any(key == allowed or (allowed.endswith(".") and key.startswith(allowed)) for allowed in RESUME_MAY_CHANGE)


def same(key: str, old, new) -> bool:
    """Whether a key's saved and new values are the same (a model folder under two spellings too)."""
    if old == new:
        return True
    if key == "model.name_or_path" and isinstance(old, str) and isinstance(new, str) and os.path.exists(new):
        return os.path.realpath(old) == os.path.realpath(new)  # runs/x and ./runs/x
    return False


def changes(saved: dict, config: Config) -> tuple[list[str], list[str]]:
    """The keys that differ between a saved config (as read from YAML) and `config`: those that
    change the run's meaning, and those that do not, each as `key: old -> new`. A key the saved
    config lacks (written by an older vlmrl) is taken at its default; one it has that `config` has
    not (removed since) is left out."""
    new = flatten(yaml.safe_load(yaml.safe_dump(saved_dict(config), sort_keys=False)))  # as it reads back, as saved
    default = flatten(yaml.safe_load(yaml.safe_dump(to_dict(Config()), sort_keys=False)))
    old = flatten(saved)
    keys = [key for key in dict.fromkeys([*new, *old]) if not key.startswith(NOT_COMPARED)
            and (key in new or key.startswith("task.params."))]
    refused, allowed = [], []
    for key in keys:
        before, after = old.get(key, default.get(key, UNSET)), new.get(key, UNSET)
        if not same(key, before, after):
            (allowed if may_change(key, old, new) else refused).append(f"{key}: {before!r} -> {after!r}")
    return refused, allowed


def saved_config(run_dir: Path) -> tuple[Path | None, dict]:
    """The latest config the run folder holds (config.resumed.yaml, else config.yaml) and its
    contents; (None, {}) when it has neither or it cannot be read."""
    for name in (RESUMED_CONFIG, STARTED_CONFIG):
        path = Path(run_dir) / name
        if path.is_file():
            try:
                data = yaml.safe_load(path.read_text(encoding="utf-8", errors="replace"))
            except (OSError, yaml.YAMLError) as error:
                warn(f"{path} cannot be read ({type(error).__name__}); checking the resume against the other config")
                continue
            if isinstance(data, dict):
                return path, data
    return None, {}


def check_resume_config(run_dir: Path, config: Config, report: bool = True) -> None:
    """Compare `config` with the run folder's latest config: VlmrlError in one line for a change of
    the run's meaning, unless config.resume_changes is "allow". With `report` (the main process),
    the changes that go through are said: a warning for the allowed meaning changes, a line for
    the others."""
    path, saved = saved_config(run_dir)
    if path is None:
        if report:
            warn(f"{run_dir} holds no readable {STARTED_CONFIG}: this resume's config is not checked against the run's")
        return
    refused, allowed = changes(saved, config)
    if refused and config.resume_changes != "allow":
        raise VlmrlError(f"resume=true would continue another run: {'; '.join(refused)} (from {path.name} to this "
                         "config). Resume with the saved values, start a new output_dir, or set "
                         "resume_changes=allow to continue with them anyway")
    if report and refused:
        warn(f"resuming with changes of what the run is (resume_changes=allow): {'; '.join(refused)}")
    if report and allowed:
        print(f"resume: changed since {path.name}: {'; '.join(allowed)}", flush=True)


def write_data_fingerprint(run_dir: Path, prints: dict[str, str]) -> None:
    """Record the fingerprint of the run's data in run_dir/data.json (nothing for generated data)."""
    path = Path(run_dir) / DATA_FINGERPRINT
    if prints:
        path.write_text(json.dumps(prints, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    else:
        path.unlink(missing_ok=True)


def check_resume_data(run_dir: Path, prints: dict[str, str], config: Config) -> None:
    """Compare the fingerprint of the data this resume reads with the one the run folder recorded:
    VlmrlError in one line naming what changed, unless config.resume_changes is "allow" (then a
    warning). A folder without data.json (a run on generated data, or from an older vlmrl) passes."""
    path = Path(run_dir) / DATA_FINGERPRINT
    try:
        saved = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError) as error:
        warn(f"{path} cannot be read ({type(error).__name__}): the resumed run's data is not checked")
        return
    if saved is None:
        if prints:
            warn(f"{run_dir} holds no {DATA_FINGERPRINT}: the resumed run's data is not checked against the run's")
        return
    changed = differences(saved if isinstance(saved, dict) else {}, prints)
    if not changed:
        return
    what = "; ".join(changed[:5]) + (f"; and {len(changed) - 5} more" if len(changed) > 5 else "")
    if config.resume_changes == "allow":
        warn(f"resuming on changed data (resume_changes=allow): {what}")
        return
    raise VlmrlError(f"resume=true would continue the run on other data: {what} (since {DATA_FINGERPRINT}). "
                     "Resume on the data the run started with, start a new output_dir, or set "
                     "resume_changes=allow to continue on this data anyway")


def check_resume_command(state: dict, command: str, folder: Path, config: Config) -> None:
    """VlmrlError when checkpoint `folder` (its trainer `state`) was saved by the other command
    (`vlmrl sft` resumed by `vlmrl train`, or the reverse), unless config.resume_changes is "allow"
    (then a warning). Checkpoints that predate the record pass."""
    saved = state.get("extra", {}).get("command")
    if saved is None or saved == command:
        return
    if config.resume_changes == "allow":
        warn(f"resuming with `vlmrl {command}` a checkpoint saved by `vlmrl {saved}` (resume_changes=allow)")
        return
    raise VlmrlError(f"resume=true would continue another run: {folder} was saved by `vlmrl {saved}`, which "
                     f"`vlmrl {command}` does not continue. Start a new output_dir (model.name_or_path=RUN/final "
                     f"starts from a finished run's model), or set resume_changes=allow to continue anyway")


def check_fresh_start(run_dir: Path) -> None:
    """VlmrlError in one line when a run with resume=false would start in `run_dir` while it holds a
    run's work: a final model, a step checkpoint or metrics rows (a run stopped before step 1 leaves
    none of them, and may start again)."""
    folder = Path(run_dir)
    checkpoints = folder / "checkpoints"
    metrics = folder / "metrics.jsonl"
    held = [what for what, there in (
        ("a final model", (folder / "final").exists()),
        ("checkpoints", checkpoints.is_dir() and any(p.name.startswith("step_") and p.is_dir()
                                                      for p in checkpoints.iterdir())),
        ("metrics", metrics.is_file() and metrics.stat().st_size > 0)) if there]
    if not held:
        return
    way = ("resume=true continues it (raise train.steps to train longer), or choose another output_dir"
           if "checkpoints" in held else "it has no checkpoint to continue from: choose another output_dir, or "
           "remove this one")
    raise VlmrlError(f"output_dir {folder} already holds a run ({', '.join(held)}) and resume is false: {way}; "
                     "a run never starts over in the folder of another")
