"""What every training command shares: processes, the policy and its optimizer, resume, the
metrics log, checkpoints and the final model.

`vlmrl train` (trainer.py) and `vlmrl sft` (sft.py) differ only in what one step does; both open a
`TrainingSession`, run their steps, and close it. Processes come from accelerate (`accelerate
launch`); on one process everything works the same.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from vlmrl.checkpoint import (latest_checkpoint, load_adapter_weights, load_trainer_state, save_checkpoint,
                              save_model)
from vlmrl.config import Config, save_config
from vlmrl.errors import VlmrlError
from vlmrl.evaluate import EvalSettings, evaluate, held_out_examples, save_evaluation, scalar_metrics
from vlmrl.models import load_policy
from vlmrl.optim import build_optimizer, build_scheduler
from vlmrl.reference import ReferencePolicy, build_reference
from vlmrl.tasks import Task
from vlmrl.tracking import build_trackers


class TrainingSession:
    """The policy, optimizer and scheduler of a run, restored from the newest checkpoint on resume.

    Attributes used by the step code: accelerator, rank, world, main, policy (the bare model),
    model (the one to call forward/backward on: wrapped for several processes), processor,
    optimizer, scheduler, reference (None unless with_reference and beta > 0), start_step,
    position (prompts consumed before start_step), run_dir.
    """

    def __init__(self, config: Config, total_updates: int, with_reference: bool = False):
        self.config = config
        self.accelerator = Accelerator(cpu=config.model.device == "cpu" or not torch.cuda.is_available())
        self.world, self.rank = self.accelerator.num_processes, self.accelerator.process_index
        self.main = self.accelerator.is_main_process
        self.run_dir = Path(config.output_dir)
        checkpoint = latest_checkpoint(self.run_dir) if config.resume else None
        if config.resume and checkpoint is None:
            raise VlmrlError(f"resume=true but {self.run_dir / 'checkpoints'} holds no checkpoint")
        set_seed(config.seed)

        self.policy, self.processor = load_trainable_policy(config, self.accelerator.device, checkpoint)
        self.reference: ReferencePolicy | None = (
            build_reference(self.policy, config.algorithm) if with_reference else None)
        self.optimizer = build_optimizer(self.policy, config.train, config.model.vision_lr_scale)
        self.scheduler = build_scheduler(self.optimizer, config.train, total_updates)
        self.start_step = self.position = 0
        if checkpoint is not None:
            state = load_trainer_state(checkpoint, self.optimizer, self.scheduler)
            self.start_step, self.position = state["step"], state["data_position"]
            if self.reference is not None:
                self.reference.load(checkpoint)
        self.model, self.optimizer = self.accelerator.prepare(self.policy, self.optimizer)

        self.log = None
        if self.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(config, self.run_dir / "config.yaml")
            self.log = build_trackers(config, self.run_dir, resume_step=self.start_step if checkpoint else None)

    def any_process(self, flag: bool) -> bool:
        """True when `flag` is True on any process."""
        total = self.accelerator.reduce(torch.tensor([float(flag)], device=self.accelerator.device), "sum")
        return bool(total > 0)

    def record(self, metrics: dict) -> None:
        """Send one step's metrics to metrics.jsonl and the configured trackers (main process)."""
        if self.main:
            self.log.log(metrics)

    def maybe_save(self, steps_done: int, position: int) -> None:
        """A checkpoint every train.save_every steps: model, optimizer, scheduler, RNG, data position."""
        every = self.config.train.save_every
        if not every or steps_done % every:
            return
        self.accelerator.wait_for_everyone()
        if self.main:
            save_checkpoint(self.run_dir, steps_done, self.policy, self.processor, self.optimizer,
                            self.scheduler, position, self.reference, keep=self.config.train.keep_checkpoints)

    def maybe_evaluate(self, steps_done: int, task: Task) -> dict[str, float]:
        """Every eval.every steps and after the last: greedy accuracy and mean rewards on the fixed
        held-out set of each eval split, as {"eval/<split>/<metric>": value}; the full results go
        to run_dir/evals/step_XXXXXX_<split>.json. Runs on the main process only."""
        settings = self.config.eval
        last = steps_done == self.config.train.steps
        if not settings.every or (steps_done % settings.every and not last):
            return {}
        metrics: dict[str, float] = {}
        if self.main:
            max_new_tokens = settings.max_new_tokens or self.config.rollout.max_new_tokens
            eval_settings = EvalSettings(batch_size=settings.batch_size, max_new_tokens=max_new_tokens,
                                         seed=self.config.seed)
            for split in settings.splits:
                examples = held_out_examples(task, split, settings.n)
                evaluation = evaluate(self.policy, self.processor, task, examples, eval_settings,
                                      show_progress=False)
                save_evaluation(evaluation, self.run_dir / "evals", f"step_{steps_done:06d}_{split}.json")
                metrics |= scalar_metrics(evaluation.results, prefix=f"eval/{split}/")
        self.accelerator.wait_for_everyone()
        return metrics

    def finish(self) -> Path:
        """Save the final model into run_dir/final and close the processes; returns run_dir."""
        self.accelerator.wait_for_everyone()
        if self.main:
            save_model(self.run_dir / "final", self.policy, self.processor)
            self.log.close()
        self.accelerator.end_training()
        return self.run_dir


def load_trainable_policy(config: Config, device: torch.device, checkpoint: Path | None):
    """The policy and processor; from `checkpoint` when resuming (full weights or LoRA adapter)."""
    settings = config.model
    source = str(checkpoint) if checkpoint is not None and not settings.lora.enabled else settings.name_or_path
    policy, processor = load_policy(
        source, dtype=settings.dtype, device=str(device), attn_implementation=settings.attn_implementation,
        lora=settings.lora, freeze_vision=settings.freeze_vision,
        gradient_checkpointing=settings.gradient_checkpointing, trust_remote_code=settings.trust_remote_code)
    if checkpoint is not None and settings.lora.enabled:
        load_adapter_weights(policy, checkpoint)
    return policy, processor
