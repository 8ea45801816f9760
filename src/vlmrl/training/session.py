"""What every training command shares: processes, the policy and its optimizer, resume, the
metrics log, checkpoints and the final model.

`vlmrl train` (trainer.py) and `vlmrl sft` (sft.py) differ only in what one step does; both open a
`TrainingSession`, run their steps, and close it. Processes come from accelerate (`accelerate
launch`); on one process everything works the same.

Faults (faults.py): optimizer updates go through `session.guard`, which skips a NaN/inf update;
after each step `check_stop` ends the run with a checkpoint when a stop signal came (SIGINT,
SIGTERM) or too many updates in a row were skipped, and `stop_at_bad_row` when a bad train example
was met mid-run with on_bad_row=error (bad_rows.py). Resume first checks the config against the
run's (a change of what the run is: one line, safety/resume.py) and the task's data against the
fingerprint in data.json (files that changed: one line), then starts from the newest
checkpoint that is whole and fits the model (its optimizer state checked against the policy loaded
from it), passing over the others with a warning; each checkpoint records its command (train or
sft), which the other command does not continue. Under several processes the main process chooses
the checkpoint and a machine whose output_dir lacks it receives it first (checkpoint_copy.py: run
folders not shared between machines). A run that loses one of its processes (killed, its machine
gone) stops on every other with one line naming the last complete checkpoint. config.yaml is the
run's first config; a resume writes its own to config.resumed.yaml. The run folder is held (folder_lock.py) from before
anything in it is read until `close()`: a second trainer started in it is refused. With
`train.background_checkpoints` a checkpoint is copied to host memory at the step's end and written
on a thread while training goes on (checkpoint_writer.py); `time/checkpoint` in the next step's
metrics is what the save of the step before kept on the step's path, `time/checkpoint_write` (in the
first row after it finished) the write's time on its thread, hidden. With `train.background_logs`
the metrics and rollouts are written on one thread (log_writer.py), drained before each checkpoint,
at the run's end and when it stops; `time/log` is what the logs kept on the step's path (the row
before's hand-off and this step's rollouts), `time/log_write` the thread's time since, hidden.
"""

from __future__ import annotations

import copy
import os
import re
import time
from functools import partial
from pathlib import Path

import torch
from accelerate.utils import set_seed

from vlmrl.config import Config, save_config
from vlmrl.disk import writing
from vlmrl.errors import Interrupted, VlmrlError, one_line, warn
from vlmrl.evaluation.evaluate import (
    EvalSettings, evaluate, held_out_count, held_out_examples, save_evaluation, scalar_metrics)
from vlmrl.models.loading import load_trainable_policy
from vlmrl.report.tracking import build_trackers
from vlmrl.rollout.sampling import broken_logits_cause, non_finite_parameters, take_broken_rows
from vlmrl.safety.bad_rows import RowGuard
from vlmrl.safety.checkpoint import (
    STATE_FILE,
    Contents,
    Gathered,
    check_checkpoint_room,
    find_resumable,
    latest_checkpoint,
    name_keyed,
    read_checkpoint,
    optimizer_problem,
    reference_missing,
    restore_trainer_state,
    host_copy,
    live_storages,
    save_checkpoint,
    save_model,
    trainer_state,
    unshared,
    write_checkpoint,
)
from vlmrl.safety.checkpoint_writer import CheckpointWriter
from vlmrl.safety.faults import MAIN_FIRST_S, NumericGuard, OptimizerUpdate, StopSignals, any_process, lost_process
from vlmrl.safety.folder_lock import FolderBusy, hold
from vlmrl.safety.preflight import copies_reference
from vlmrl.safety.resume import (
    RESUMED_CONFIG,
    STARTED_CONFIG,
    check_fresh_start,
    check_resume_command,
    check_resume_config,
    check_resume_data,
    write_data_fingerprint,
)
from vlmrl.tasks import Task
from vlmrl.training import zero3
from vlmrl.training.checkpoint_copy import checkpoint_everywhere
from vlmrl.training.log_writer import LogWriter
from vlmrl.training.optim import build_optimizer, build_scheduler, optimizer_layout
from vlmrl.training.reference import ReferencePolicy, build_reference
from vlmrl.training.sharding import FullStateOptimizer, distinct_names, full_state, gathered, is_sharded, shard
from vlmrl.training.strategy import make_accelerator, refuse_unrunnable, settle_strategy
from vlmrl.training.teacher import Teacher, check_teacher_fits, load_teacher


class TrainingSession:
    """The policy, optimizer and scheduler of a run, restored from the newest checkpoint on resume.

    Attributes used by the step code: accelerator, rank, world, main, policy (the bare model),
    model (the one to call forward/backward on: wrapped for several processes), processor,
    optimizer, scheduler, reference (None unless with_reference and beta > 0), teacher (None unless
    with_reference and algorithm.teacher: on-policy distillation, teacher.py), start_step,
    cursor (the data cursor: index of the next train example, i.e. examples consumed before
    start_step), run_dir, guard (NumericGuard: make every optimizer update through
    `guard.step(session.update, ...)`), update (how an update is made: accelerate's, or DeepSpeed's).
    """

    def __init__(self, config: Config, total_updates: int, with_reference: bool = False,
                 task: Task | None = None):
        self.config = config
        self.task = task  # its data's fingerprint is checked on resume and recorded in the run folder
        refuse_unrunnable(os.environ)  # before accelerate reads the same variables
        self.accelerator = make_accelerator(config.model.device, os.environ)
        self.world, self.rank = self.accelerator.num_processes, self.accelerator.process_index
        self.main = self.accelerator.is_main_process
        launched = self.accelerator.state
        self.strategy = settle_strategy(launched.distributed_type.name, self.world, launched.backend,
                                        self.accelerator.device.type, os.environ)  # before anything loads
        if self.strategy.deepspeed:
            zero3.configure(self.accelerator, config.train.max_grad_norm)
        self.run_dir = Path(config.output_dir)
        self.command = "train" if with_reference else "sft"  # recorded in each checkpoint, checked on resume
        self.folder_lock = self.hold_run_folder()
        try:
            self.open(config, with_reference, total_updates)
        except BaseException:  # a session that fails to open gives the folder back (a notebook may call again)
            if self.folder_lock is not None:
                self.folder_lock.release()
            raise

    def open(self, config: Config, with_reference: bool, total_updates: int) -> None:
        """Everything of `__init__` once the run folder is held: the policy (from the checkpoint on resume),
        the reference, the teacher, sharding, the optimizer and scheduler, the logs and the signals."""
        checkpoint, state = self.open_policy(with_reference)  # self.policy, self.processor
        self.reference: ReferencePolicy | None = (
            build_reference(self.policy, config.algorithm) if with_reference else None)
        if checkpoint is not None and self.reference is not None:
            self.reference.load(checkpoint)
        self.teacher: Teacher | None = self.load_teacher() if with_reference else None
        reference_copy = getattr(self.reference, "copy", None)
        frozen = [m for m in (reference_copy, getattr(self.teacher, "model", None)) if m is not None]
        if self.strategy.self_sharded:  # FSDP2, applied by vlmrl (sharding.py): policy, reference and teacher alike
            for model in [self.policy] + frozen:
                shard(model, self.world, self.accelerator.device, self.strategy.reshard_after_forward,
                      self.strategy.weights_from_main)
        elif self.strategy.deepspeed:  # ZeRO-3: the policy partitioned before prepare, the reference and teacher whole
            zero3.partition(self.policy, self.accelerator)
            for model in frozen:
                model.to(self.accelerator.device)
        self.optimizer = build_optimizer(self.policy, config.train, config.model.vision_lr_scale, config.seed)
        self.scheduler = build_scheduler(self.optimizer, config.train, total_updates)
        self.start_step = self.cursor = 0
        self.carried: dict = {}  # plain data the step code keeps in each checkpoint: the rollouts made ahead (ahead.py)
        self.guard = NumericGuard(config.train.max_bad_steps, config.train.max_grad_norm)
        if self.strategy.self_sharded:
            self.model = self.policy  # sharded in place (accelerate would wrap it in DDP on CPU processes)
        else:  # DDP, or a DeepSpeed engine that partitions the policy (ZeRO-3)
            self.model, self.optimizer = self.accelerator.prepare(self.policy, self.optimizer)
        self.update = (zero3.EngineUpdate(self.accelerator, self.model, self.policy) if self.strategy.deepspeed
                       else OptimizerUpdate(self.accelerator, self.model, self.optimizer))
        if checkpoint is not None:  # after sharding and prepare: the optimizer's parameters are the final ones
            if is_sharded(self.policy) or zero3.is_partitioned(self.policy):  # they restore states keyed by name
                state = {**state, "optimizer": name_keyed(state["optimizer"], self.layout)}
            restored = restore_trainer_state(state, self.restorable_optimizer(), self.scheduler)
            self.start_step, self.cursor = restored["step"], restored["data_position"]
            self.guard.load_state_dict(restored["extra"].get("faults", {}))
            self.carried = restored["extra"].get("ahead", {})

        self.log = None
        if self.main:
            self.write_config(resumed=checkpoint is not None)
            self.log = build_trackers(config, self.run_dir, resume_step=self.start_step if checkpoint else None)
        self.logs = LogWriter(background=config.train.background_logs and self.main)  # metrics.jsonl, rollouts/
        self.log_seconds = 0.0  # the logs' time on the step's path since the last row (time/log)
        self.saved_step = self.start_step if checkpoint is not None else None
        self.held_out: dict[str, list] = {}  # eval split -> its fixed held-out examples
        self.closed = False
        self.closers: list = []  # what `close` calls first: the step code's own workers (the prefetcher)
        self.writer = CheckpointWriter()  # train.background_checkpoints: the checkpoint being written
        self.save_seconds = 0.0  # the last save's time on the step's path (time/checkpoint)
        self.signals = StopSignals()  # from here on, SIGINT / SIGTERM stop after the step with a checkpoint

    def open_policy(self, with_reference: bool) -> tuple[Path | None, dict | None]:
        """Load self.policy and self.processor: on resume, from the newest checkpoint that is whole and
        fits the run, once the config is checked against the run's (safety/resume.py); else from
        model.name_or_path. Then check that the run can write its checkpoints, before step 1. Returns
        the checkpoint's folder and trainer state, (None, None) for a fresh run."""
        config = self.config
        found = None
        if config.resume:
            check_resume_config(self.run_dir, config, report=self.main)  # before anything is loaded
            self.on_main(check_resume_data, self.run_dir, self.data_fingerprint(), config)
            self.needs_reference = with_reference and copies_reference(config, "train")
            found = self.resumable()
            if found is None:
                raise VlmrlError(f"resume=true but {self.run_dir / 'checkpoints'} holds no checkpoint")
        else:
            self.on_main(check_fresh_start, self.run_dir)  # never start over in a run's folder
        self.on_main(check_checkpoint_room, self.run_dir, found[1]["step"] if found else 0, config.train.steps)
        if found is None:  # a fresh run: loaded once the checkpoints are known to be writable
            self.load_policy(None)
        return found if found is not None else (None, None)

    def resumable(self) -> tuple[Path, dict] | None:
        """(folder, trainer state) of the checkpoint to resume from, the policy loaded from it (`fits`):
        the newest whole one that fits, as the main process finds it in its run_dir; on the other
        processes the same one, in theirs, received from the main process where it lacks (machines
        whose output_dir is not shared: checkpoint_copy.py). None when the main process finds none."""
        if self.world == 1:
            return find_resumable(self.run_dir, fits=self.fits)
        self.on_main(self.find_on_main)
        chosen = self.found[0] if self.main and self.found else None
        folder = checkpoint_everywhere(self.accelerator, self.run_dir, chosen)
        if folder is None:
            return None
        found, problem = self.found if self.main else (folder, None), None
        if not self.main:
            try:
                found = folder, read_checkpoint(folder)
                problem = self.fits(*found)
            except VlmrlError as error:
                problem = str(error)
        if self.any_process(problem is not None):  # every process: the main one has loaded it already
            raise VlmrlError(problem or "another process could not load the checkpoint the main process chose (see "
                             "its error)")
        return found

    def find_on_main(self) -> None:
        """`resumable`'s main-process part: self.found."""
        self.found = find_resumable(self.run_dir, fits=self.fits)

    def fits(self, folder: Path, state: dict) -> str | None:
        """`find_resumable`'s check of a checkpoint whose files are whole: saved by this command (else
        VlmrlError), holding the reference copy the run needs, then the policy loaded from it and its
        optimizer state checked against the policy's optimizer (self.layout); what does not fit, or None."""
        check_resume_command(state, self.command, folder, self.config)
        missing = reference_missing(folder) if self.needs_reference else None
        if missing:
            return missing
        self.load_policy(folder)
        self.layout = optimizer_layout(self.policy, self.config.model.vision_lr_scale)
        problem = optimizer_problem(state["optimizer"], self.layout)
        return problem and f"{STATE_FILE} {problem}"

    def load_policy(self, checkpoint: Path | None) -> None:
        """self.policy and self.processor, from `checkpoint` or (None) model.name_or_path."""
        set_seed(self.config.seed)
        self.policy, self.processor = load_trainable_policy(self.config, self.accelerator.device, checkpoint,
                                                            self.strategy.loading_place(self.rank))

    def on_main(self, check, *args) -> None:
        """`check(*args)` on the main process; a VlmrlError it raises is raised on every process (on
        the others after MAIN_FIRST_S, so the main process's line is the one the launch shows)."""
        problem = None
        if self.main:
            try:
                check(*args)
            except VlmrlError as error:
                problem = error
        if self.any_process(problem is not None):
            if problem is None:
                time.sleep(MAIN_FIRST_S)
            raise problem or VlmrlError("the main process stopped the run (see its error)")

    def data_fingerprint(self) -> dict[str, str]:
        """The fingerprint of the task's data (main process; computed once): {} without a task."""
        if not hasattr(self, "_data_prints"):
            self._data_prints = self.task.data_fingerprint() if self.task is not None and self.main else {}
        return self._data_prints

    def write_config(self, resumed: bool) -> None:
        """The run's config into run_dir (main process): config.yaml for a fresh run (a stale
        config.resumed.yaml removed), config.resumed.yaml beside the kept config.yaml on resume; the
        data's fingerprint into data.json."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_data_fingerprint(self.run_dir, self.data_fingerprint())
        if resumed and (self.run_dir / STARTED_CONFIG).is_file():
            save_config(self.config, self.run_dir / RESUMED_CONFIG)
            return
        save_config(self.config, self.run_dir / STARTED_CONFIG)
        if not resumed:
            (self.run_dir / RESUMED_CONFIG).unlink(missing_ok=True)

    def load_teacher(self) -> Teacher | None:
        """The distillation teacher (teacher.py; None without algorithm.teacher), placed as the policy is,
        after refusing in one line a teacher whose weights cannot fit in the device's free memory."""
        if not self.config.algorithm.teacher:
            return None
        check_teacher_fits(self.config, self.accelerator.device, self.world if self.strategy.self_sharded else 1)
        return load_teacher(self.config, self.accelerator.device, self.strategy.loading_place(self.rank))

    def hold_run_folder(self):
        """The main process's hold on run_dir (None elsewhere); FolderBusy on every process when
        another trainer is in it, before this one reads or writes anything there."""
        folder_lock, busy = None, None
        if self.main:
            try:
                folder_lock = hold(self.run_dir, "another vlmrl run")
            except FolderBusy as error:
                busy = error
        if self.any_process(busy is not None):
            raise busy or FolderBusy(f"{self.run_dir} is in use by another vlmrl run")
        return folder_lock

    def gathered(self, model: torch.nn.Module | None = None):
        """A context within which a sharded policy (or `model`: the teacher, sharded like it) is
        gathered on every process as generation gathers it: FSDP2 (rollout.fsdp_generation: whole, or
        its root and first blocks: sharding.gathered), ZeRO-3 whole with DeepSpeed's hooks off
        (zero3.gathered). Call on every process."""
        model = self.policy if model is None else model
        if zero3.is_partitioned(model):
            return zero3.gathered(model)
        return gathered(model, self.config.rollout.fsdp_generation == "whole")

    @property
    def gathers_by_layer(self) -> bool:
        """Within `gathered`, FSDP2 still gathers the other blocks at each forward: every process must
        run the same forwards (rollout.fsdp_generation=layers)."""
        return self.layer_gathered(self.policy)

    def layer_gathered(self, model: torch.nn.Module) -> bool:
        """`gathers_by_layer` for `model`."""
        return is_sharded(model) and self.config.rollout.fsdp_generation != "whole"

    def restorable_optimizer(self):
        """The optimizer as a checkpoint's state goes back into it: whole (one process, DDP), or the
        full state dict saved by a sharded run put back into each process's part."""
        if is_sharded(self.policy):
            return FullStateOptimizer(self.policy, self.optimizer)
        if zero3.is_partitioned(self.policy):
            return zero3.FullStateOptimizer(self.policy)
        return self.optimizer

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Backward of one micro-batch's weighted loss (`last`: the update's last micro-batch). A
        DeepSpeed engine takes it itself and keeps the gradients until `guard.step`."""
        if self.strategy.deepspeed:
            self.model.set_gradient_accumulation_boundary(last)
            self.model.backward(loss)
        else:
            self.accelerator.backward(loss)

    def any_process(self, flag: bool) -> bool:
        """True when `flag` is True on any process."""
        return any_process(self.accelerator, flag)

    def record(self, metrics: dict) -> None:
        """Send one step's metrics to metrics.jsonl and the configured trackers (main process): the
        files through the log writer (a copy of the row: on its thread with train.background_logs),
        W&B and trackio on this thread."""
        if self.main:
            started = time.perf_counter()
            row = dict(metrics)
            self.logs.put(partial(self.log.log_files, row))
            self.log.log_main(row)
            self.log_seconds += time.perf_counter() - started

    def take_log_seconds(self) -> dict[str, float]:
        """{"time/log": the logs' seconds on the step's path since the last call, "time/log_write": the
        log thread's seconds on the writes it finished since (0 when they are written on the path)}."""
        seconds, self.log_seconds = self.log_seconds, 0.0
        return {"time/log": seconds, "time/log_write": self.logs.take_seconds()}

    def maybe_save(self, steps_done: int, cursor: int) -> None:
        """A checkpoint every train.save_every steps and after the last (with save_every=0, only after
        the last): model, optimizer, scheduler, RNG, data cursor."""
        every, last = self.config.train.save_every, steps_done == self.config.train.steps
        if self.config.train.background_checkpoints:
            self.on_main(self.writer.check)  # a background write that failed stops the run here, in one line
        if last or (every and steps_done % every == 0):
            self.save(steps_done, cursor)

    def take_save_seconds(self) -> dict[str, float]:
        """{"time/checkpoint": the last save's seconds on the step's path} once after a save, and
        {"time/checkpoint_write": a background write's seconds on its thread} once after it finished."""
        seconds, self.save_seconds = self.save_seconds, 0.0
        written = self.writer.take_seconds() if self.main else None
        return ({"time/checkpoint": seconds} if seconds else {}) | (
            {"time/checkpoint_write": written} if written is not None else {})

    def save(self, steps_done: int, cursor: int) -> Path:
        """A checkpoint now (all processes call this); returns its folder."""
        folder = self.run_dir / "checkpoints" / f"step_{steps_done:06d}"
        started = time.perf_counter()
        self.on_main(self.logs.drain)  # every line logged so far is on disk before the checkpoint is
        self.accelerator.wait_for_everyone()
        self.refuse_non_finite_weights(f"checkpoint of step {steps_done}")
        whole = self.gather_state(for_checkpoint=True)  # every process takes part in gathering a sharded run's
        # the main process writes; its one-line error (a full disk) stops every process in one line, not
        # the others in a traceback at their next collective once it has gone
        if self.config.train.background_checkpoints:
            self.on_main(self.writer.wait)  # the one before is whole and durable first (its failure: one line)
            self.on_main(self.write_in_background, steps_done, cursor, whole)
        else:
            self.on_main(self.write_checkpoint, steps_done, cursor, whole)
        self.saved_step = steps_done
        self.save_seconds = time.perf_counter() - started
        return folder

    def write_in_background(self, steps_done: int, cursor: int, whole: Gathered | None) -> None:
        """The main process's part of `save` with background checkpoints: what the checkpoint holds
        copied to host memory now (a sharded run's gathered states are copies already, but ZeRO-3
        gathers no reference: its live copy is copied here), written by the writer's thread while
        training goes on."""
        if not hasattr(self, "saving_processor"):
            self.saving_processor = copy.deepcopy(self.processor)  # the thread's own: a tokenizer is not shared
        if whole is not None:
            optimizer, weights, reference = whole.optimizer, whole.weights, whole.reference
            if optimizer is not None:  # FSDP2 hands a 0-d CPU tensor (AdamW's `step`) back live: cloned
                optimizer = unshared(optimizer, live_storages(self.optimizer))
            if reference is None and self.reference is not None:  # ZeRO-3 gathers no reference: its copy is
                reference = host_copy(self.reference.saved_weights())  # whole and live (refresh lerps it in place)
        else:
            optimizer = host_copy(self.optimizer.state_dict())
            weights = host_copy(own_weights(self.policy))
            reference = host_copy(self.reference.saved_weights()) if self.reference is not None else None
        extra = host_copy({"faults": self.guard.state_dict(), "command": self.command, "ahead": self.carried})
        state = trainer_state(steps_done, cursor, optimizer, self.scheduler, extra)
        state["scheduler"] = host_copy(state["scheduler"])
        contents = Contents(steps_done, state, weights, reference)
        owners = (self.policy, self.saving_processor, self.reference)
        self.writer.start(partial(write_checkpoint, self.run_dir, contents, owners, self.config.train.keep_checkpoints))

    def write_checkpoint(self, steps_done: int, cursor: int, whole: Gathered | None) -> None:
        """The main process's part of `save`: the checkpoint of `steps_done` written to its folder."""
        save_checkpoint(self.run_dir, steps_done, self.policy, self.processor, self.optimizer, self.scheduler,
                        cursor, self.reference, keep=self.config.train.keep_checkpoints,
                        extra={"faults": self.guard.state_dict(), "command": self.command, "ahead": self.carried},
                        gathered=whole)

    def refuse_non_finite_weights(self, what: str) -> None:
        """Stop in one line, writing nothing, when the policy's weights hold NaN/inf on any process:
        such a save would replace good checkpoints (keep_checkpoints) with a broken one."""
        bad = non_finite_parameters(self.policy)
        if self.any_process(bool(bad)):
            self.close()
            named = ", ".join(bad[:3]) or "on another process"
            raise VlmrlError(f"the weights hold NaN/inf ({named}); the {what} is not written, the checkpoints on "
                             "disk are older. An update made them: look for NaN optimizer state restored from a "
                             "checkpoint, or too high a train.lr")

    def gather_state(self, for_checkpoint: bool) -> Gathered | None:
        """The full state dicts of a sharded run's policy, gathered on every process (all must call
        this), with the optimizer's and the reference copy's `for_checkpoint`; None when nothing is
        sharded."""
        if zero3.is_partitioned(self.policy):
            return Gathered(*zero3.full_state(self.policy, for_checkpoint))  # the reference copy is whole
        if not is_sharded(self.policy):
            return None
        weights, moments = full_state(self.policy, self.optimizer if for_checkpoint else None)
        copy = getattr(self.reference, "copy", None)
        reference = full_state(copy)[0] if copy is not None and for_checkpoint else None
        return Gathered(weights, moments, reference)

    def check_stop(self, steps_done: int, cursor: int) -> None:
        """After a step: when a stop signal came (on any process) or train.max_bad_steps updates in
        a row were skipped, save a checkpoint (unless this step has one), close the logs and raise
        Interrupted or VlmrlError."""
        signum = self.signals.received or 0
        if self.world > 1:
            signum = int(self.accelerator.gather(torch.tensor([signum], device=self.accelerator.device)).max())
        if not signum and not self.guard.exhausted:
            return
        folder = self.save_and_close(steps_done, cursor)
        if signum:
            raise Interrupted(signum, steps_done, folder)
        raise VlmrlError(
            f"the loss or gradient was NaN/inf in {self.guard.in_a_row} updates in a row (train.max_bad_steps="
            f"{self.config.train.max_bad_steps}); stopped after step {steps_done} with a checkpoint in {folder} "
            "holding the last good weights. Look for a reward or advantage that is not finite, too high a "
            "train.lr, or fp16 overflow; resume=true continues from it as it was, and a new train.lr or "
            "model.dtype is a new run started from its weights (model.name_or_path=that checkpoint)")

    def make_held_out(self, task: Task) -> None:
        """The fixed held-out set of every eval split (when eval.every > 0), made on the main process
        before step 1 with each example encoded once: a bad one follows the task's on_bad_row
        (bad_rows.py), replaced by the next good one, or the run stops here in one line, before any
        work (it used to crash at the first evaluation)."""
        settings, stop = self.config.eval, None
        if self.main and settings.every:
            for split in settings.splits:
                guard = RowGuard(task, self.processor, split, self.config.rollout.max_prompt_length)
                _, self.held_out[split] = guard.checked(list(range(held_out_count(task, split, settings.n))))
                stop = stop or guard.stop
        if self.any_process(stop is not None):
            self.close()
            raise VlmrlError(f"bad held-out data: {stop or 'the main process met a bad eval example'}; fix the data, "
                             "or set task.params.on_bad_row=skip to replace bad rows by the next good ones")

    def stop_at_broken_logits(self, steps_done: int, cursor: int) -> None:
        """When any process sampled this step from NaN/inf logits (sampling.py): stop in one line
        naming the cause. The weights are the last finished step's (`cursor`: its data cursor): saved
        when finite (unless saved already), never when not, so the checkpoints on disk stay good ones."""
        rows = take_broken_rows(self.policy)
        if not self.any_process(rows > 0):
            return
        bad = non_finite_parameters(self.policy)
        cause = broken_logits_cause(rows, bad) if rows else "another process sampled from NaN/inf logits"
        if self.any_process(bool(bad)):
            kept = sorted((self.run_dir / "checkpoints").glob("step_*"))
            where = f"the last checkpoint, {kept[-1]}, is older" if kept else "no checkpoint was written"
            self.close()
            raise VlmrlError(f"stopped at step {steps_done + 1}: {cause}. Nothing saved from these weights ({where})")
        folder = self.save_and_close(steps_done, cursor)
        raise VlmrlError(f"stopped at step {steps_done + 1}: {cause}. Checkpoint of step {steps_done}: {folder}")

    def save_and_close(self, steps_done: int, cursor: int) -> Path:
        """A checkpoint of the last finished step (unless it has one; `cursor`: its data cursor), then
        close; returns the checkpoint's folder."""
        folder = self.run_dir / "checkpoints" / f"step_{steps_done:06d}"
        if self.saved_step != steps_done:
            folder = self.save(steps_done, cursor)
        self.on_main(self.writer.wait)  # written in the background: whole on disk before the run says so
        self.close()
        return folder

    def stop_at_reward_failure(self, failure: str | None, steps_done: int, cursor: int) -> None:
        """When a reward failed on any process this step (rewards/score.py: it raised, answered wrongly,
        applied to no reward, or its service stayed down): save a checkpoint of the last finished step,
        close, and stop in one line naming the reward, the prompt and the completion."""
        if not self.any_process(failure is not None):
            return
        folder = self.save_and_close(steps_done, cursor)
        raise VlmrlError(f"a reward failed at step {steps_done + 1}: {failure or 'on another process'}; stopped with "
                         f"a checkpoint of step {steps_done} in {folder} (resume=true continues from it once the "
                         "reward is fixed)")

    def stop_at_bad_row(self, stop: str | None, steps_done: int, cursor: int) -> None:
        """When any process met a bad train example (`stop`: this process's `RowGuard.stop`) and the
        task's on_bad_row is "error": save a checkpoint of the last finished step (`cursor`: its data
        cursor, before this step's draw), close, and stop in one line naming the example (bad_rows.py)."""
        if not self.any_process(stop is not None):
            return
        folder = self.save_and_close(steps_done, cursor)
        reason = stop or "another process met a bad train example"
        raise VlmrlError(f"bad data at step {steps_done + 1}: {reason}; stopped with a checkpoint of step {steps_done} "
                         f"in {folder}. Fix the data, or set task.params.on_bad_row=skip to replace bad rows by the "
                         "next good ones, then resume=true")

    def __enter__(self) -> "TrainingSession":
        return self

    def __exit__(self, kind, error, trace) -> None:
        """A run that ends in an error (or Ctrl-C) closes too: the signal handlers go back, so a
        notebook's next Ctrl-C is its own, and the run folder is given back. An error that says
        another process is gone (faults.lost_process) becomes one line naming the last checkpoint."""
        if error is None:
            return
        if not lost_process(error):
            self.close()
            return
        try:
            self.close()  # a checkpoint being written in the background is finished first
        except Exception:  # noqa: BLE001 - tearing down a group whose peer is gone may fail too: the line says why
            pass
        raise VlmrlError(self.lost_process_line(error)) from error

    def lost_process_line(self, error: BaseException) -> str:
        """The one line of a run that lost another of its processes (`error`, torch.distributed's)."""
        latest = latest_checkpoint(self.run_dir)
        where = (f"the last complete checkpoint is {latest}" if latest is not None else
                 f"{self.run_dir / 'checkpoints'} holds no checkpoint here (the main process writes them)")
        return (f"another process of the run is gone (process {self.rank} of {self.world} lost it: "
                f"{lost_words(error)}); {where}. Find why it stopped (its machine's log), then launch "
                "again on every machine with resume=true")

    def close(self) -> None:
        """Close the logs, give the signal handlers and the run folder back (the model is not saved).
        Once: a later call does nothing."""
        if self.closed:
            return
        self.closed = True
        for close in self.closers:
            close()
        try:
            self.logs.close()  # every line handed to the log thread written, whatever ended the run
        except Exception as error:  # noqa: BLE001 - the run is ending on its own error: say this one too
            warn(f"the logs written in the background failed: {one_line(error)}")
        try:
            self.writer.wait()  # a checkpoint being written is finished, whatever ended the run
        except Exception as error:  # noqa: BLE001 - the run is ending on its own error: say this one too
            warn(f"the checkpoint written in the background failed: {one_line(error)}")
        self.signals.restore()
        if self.main:
            try:
                self.log.close()
            finally:
                self.folder_lock.release()
        release_process_group(self.model)
        self.accelerator.end_training()

    def maybe_evaluate(self, steps_done: int, task: Task) -> dict[str, float]:
        """Every eval.every steps and after the last: greedy accuracy and mean rewards on the fixed
        held-out set of each eval split, as {"eval/<split>/<metric>": value}; the full results go
        to run_dir/evals/step_XXXXXX_<split>.json. Runs on the main process only (a sharded model is
        gathered on every process for it first)."""
        settings = self.config.eval
        last = steps_done == self.config.train.steps
        if not settings.every or (steps_done % settings.every and not last):
            return {}
        return self.evaluate(self.policy, steps_done, task)

    def evaluate_teacher(self, task: Task) -> dict[str, float]:
        """The distillation teacher's held-out accuracy, once, at the start of a run that evaluates
        (eval.every > 0; not again on resume): {"step": 0, "eval/<split>/teacher/<metric>": value}
        on each eval split's fixed held-out set, the same greedy evaluation as the policy's (no blind
        check), its results in run_dir/evals/step_000000_<split>_teacher.json. Sharded under FSDP2,
        the teacher is gathered for it as the policy is for its own; whole under ZeRO-3. {} on the
        other processes, or without a teacher."""
        if self.teacher is None or not self.config.eval.every or self.start_step:
            return {}
        metrics = self.evaluate(self.teacher.model, 0, task, "teacher")
        return metrics | {"step": 0} if self.main else {}

    def evaluate(self, model: torch.nn.Module, steps_done: int, task: Task, who: str = "") -> dict[str, float]:
        """`model` (the policy, or the teacher: `who`) evaluated on every eval split (`_evaluate`);
        call on every process."""
        metrics: dict[str, float] = {}
        with self.gathered(model):  # sharded: every process gathers, the main one evaluates
            if self.main or self.layer_gathered(model):  # gathered by layers: all run the forwards
                metrics = self._evaluate(model, steps_done, task, who)
        self.accelerator.wait_for_everyone()
        return metrics if self.main else {}

    def _evaluate(self, model: torch.nn.Module, steps_done: int, task: Task, who: str) -> dict[str, float]:
        """`evaluate`'s work (the main process writes the results): eval/<split>/[<who>/]<metric>."""
        settings = self.config.eval
        metrics: dict[str, float] = {}
        max_new_tokens = settings.max_new_tokens or self.config.rollout.max_new_tokens
        rollout = self.config.rollout
        eval_settings = EvalSettings(batch_size=settings.batch_size, max_new_tokens=max_new_tokens,
                                     seed=self.config.seed, tools=list(rollout.tools), tool_models=dict(rollout.tool_models),
                                     max_turns=rollout.max_turns,
                                     max_trajectory_tokens=rollout.max_trajectory_tokens,
                                     tool_image_side=rollout.tool_image_side, decode=rollout.decode,
                                     blind_check=settings.blind_check and not who, rewards=list(self.config.rewards))
        for split in settings.splits:
            if split not in self.held_out:  # the same fixed set at every evaluation: make it once
                self.held_out[split] = held_out_examples(task, split, settings.n)
            examples = self.held_out[split]
            evaluation = evaluate(model, self.processor, task, examples, eval_settings, show_progress=False)
            if self.main:
                name = f"step_{steps_done:06d}_{split}{'_' + who if who else ''}.json"
                save_evaluation(evaluation, self.run_dir / "evals", name)
            metrics |= scalar_metrics(evaluation.results, prefix=f"eval/{split}/{who + '/' if who else ''}")
        return metrics

    def write_final(self, whole: Gathered | None) -> None:
        """The main process's part of `finish`: the final model written to run_dir/final."""
        with writing("the final model", self.run_dir / "final"):
            save_model(self.run_dir / "final", self.policy, self.processor, whole and whole.weights)

    def finish(self) -> Path:
        """Save the final model into run_dir/final and close the processes; returns run_dir."""
        self.accelerator.wait_for_everyone()
        self.on_main(self.logs.drain)  # every line logged, or the failure of a write in one line
        self.on_main(self.writer.wait)  # the last checkpoint whole and durable before the run ends
        self.refuse_non_finite_weights("final model")
        whole = self.gather_state(for_checkpoint=False)
        self.on_main(self.write_final, whole)  # a full disk: one line on every process (see `save`)
        # every process tears its process group down together: one that left while the main one still
        # wrote has been seen to abort at exit ("terminate called without an active exception")
        self.accelerator.wait_for_everyone()
        self.close()
        return self.run_dir


class StepClock:
    """A step's clocks, started when made: `metrics()` gives its wall-clock `seconds` and `time/cpu`,
    this process's CPU seconds in it (user + sys, all its threads), as GRPO and SFT log them."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def metrics(self) -> dict[str, float]:
        """{"seconds": wall-clock seconds since the clock started, "time/cpu": CPU seconds since then}."""
        return {"seconds": time.perf_counter() - self.wall, "time/cpu": time.process_time() - self.cpu}


def own_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict with each tensor once (a tied weight under its first name: what
    save_pretrained and safetensors keep), as a sharded run's gathered weights are; of a LoRA policy
    (peft), the adapter's tensors alone, under the same names: what its save_pretrained keeps of the
    state dict it is given, so that a background checkpoint copies the adapter, not the base model."""
    names = distinct_names(model)
    weights = {name: value for name, value in model.state_dict().items() if name in names}
    if hasattr(model, "peft_config"):
        from peft import get_peft_model_state_dict

        kept = {id(value) for value in get_peft_model_state_dict(model, state_dict=weights).values()}
        if kept <= {id(value) for value in weights.values()}:  # the same tensors, renamed: keep them by name
            weights = {name: value for name, value in weights.items() if id(value) in kept}
    return weights


def lost_words(error: BaseException) -> str:
    """torch.distributed's error in a few words: gloo's "[.../gloo/transport/tcp/pair.cc:553] Connection
    closed by peer [127.0.0.1]:60305. This is typically caused by..." -> its first sentence, no source path."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", one_line(error))
    return text.split(". ")[0][:200]


def epoch_metric(task: Task, seen: int) -> dict[str, float]:
    """{"epoch": passes over the train rows that `seen` train examples make (1.5: one and a half)} for a
    task whose train split has a size (a file-backed one: `size`), {} for a generator (no end)."""
    rows = task.size("train") if hasattr(task, "size") else None
    return {"epoch": seen / rows} if rows else {}


def release_process_group(model: torch.nn.Module) -> None:
    """Let a DistributedDataParallel `model` go without a deadlock at exit, by dropping its C++
    owners of the process group (its reducer, and the logger that holds the reducer) now.

    Otherwise the reducer may be the group's last owner, and torch frees a reducer holding the GIL:
    gloo's destructor then waits for its worker thread, which may itself wait for the GIL to free a
    tensor of the last collective (seen: a two-process CPU run hung after its last step). The
    group's last owner is now a Python ProcessGroup, whose destructor lets the GIL go first."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model.logger = model.reducer = None  # the model cannot train after this; close() ends the run
