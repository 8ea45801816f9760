"""Rollouts one step ahead (rollout.ahead=1): step k trains on rollouts made with the weights of step k-1.

A synchronous step waits twice: the update waits for the step's rollouts, the next rollouts for the
update. With rollout.ahead=1, the rollouts of step k+1 are made with the weights the update of step
k starts from, so making them can run while that update runs. The lag is one step (0 at a run's
first step), logged as `rollout/lag_steps`. The loss treats the batch as any off-policy one: the
sampler's log-probs were recorded by the weights of step k-1, and the importance weights against
the sampler (algorithm.tis_cap, tis_floor, tis_mode: grpo.py) correct the lag as they correct a
sampler's rounding; `mismatch_kl` shows its size.

Where a step's rollouts come from, behind one interface for the trainer loop (`take(step, cursor)`
before the update, `after_update(step)` after it, `state()` for the checkpoint):
- `Synchronous` (ahead=0): `collect_experience`, as always.
- `OneStepAhead` (ahead=1, each process generating its own share): `take(k)` hands over the rollouts
  made before the update of step k-1 and makes those of step k+1 with the weights of now. This is
  the schedule, in one process; a launch with a generator is held equal to it.
- `FromGenerators` (ahead=1, rollout.generators=1): the launch's last process only generates
  (`run_generator`) and the others only train. `split_launch` gives the trainers a process group of
  their own (accelerate and DDP or FSDP2 run among them as in any launch), the generator one of its
  own on other keys of the store, and joins every process in a second gloo group, `Link`, made on
  the launcher's rendezvous store: the generator sends each trainer its share of a step's rollouts
  (token ids, the sampler's log-probs, rewards, advantages, the examples) over it; trainer 0 sends
  the generator the weights after each update (every parameter first, then the trainable ones: a
  LoRA policy's adapter), in chunks. FSDP2 trainers gather the policy whole first, as generation
  gathers it (sharding.gathered: a collective every trainer joins at the same point), and trainer 0
  sends its full tensors; ZeRO-3 is refused in `split_launch` (DeepSpeed would engage in the
  generator too). The generator makes a step's whole batch as one process does, so each trainer
  trains on what the one-process schedule trains on. While the trainers update with the rollouts
  of step k, the generator makes those of step k+1 with the weights of step k.

Resume is exact: the rollouts made ahead (those of the step after the checkpoint) are kept in the
checkpoint's trainer state as plain data (ids, masks, log-probs, rewards, advantages, the examples'
indices; each example is made again from its index, a task being deterministic), and taken from
there. Multi-turn tool rollouts are not run ahead (config.py refuses it).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from accelerate.utils import set_seed

from vlmrl.config import Config
from vlmrl.errors import VlmrlError
from vlmrl.models.loading import load_trainable_policy
from vlmrl.rollout.generation import Rollout
from vlmrl.rollout.sampling import note_broken_rows, take_broken_rows
from vlmrl.safety.bad_rows import RowGuard, make_example
from vlmrl.safety.early_checks import launched_world
from vlmrl.tasks import Task
from vlmrl.training.experience import STEP_SECONDS, Experience, GroupSampler, collect_experience
from vlmrl.training.optim import freeze_unscaled_vision
from vlmrl.training.sharding import gathered
from vlmrl.training.strategy import make_accelerator, requested_strategy

LINK_TIMEOUT = timedelta(minutes=30)
"""How long a process of the link waits for the other side (gloo's default)."""

CHUNK_BYTES = 64 * 2 ** 20
"""Most bytes of weights per broadcast."""

Taken = tuple[Experience | None, int, int]
"""A step's experience (None when a reward failed), the data cursor after it, and its lag in steps."""


def experience_state(experience: Experience, cursor: int, lag: int) -> dict:
    """`experience` (made ahead; `cursor`: the data cursor after it) as plain data for a checkpoint
    (loaded with weights_only=True): tensors, numbers, strings, the examples' indices."""
    rollout = experience.rollout
    return {"indices": list(experience.indices), "cursor": cursor, "lag": lag,
            "group": len(rollout.rows) // max(len(experience.indices), 1),
            "completion_ids": rollout.completion_ids.cpu(), "completion_mask": rollout.completion_mask.cpu(),
            "texts": list(rollout.texts), "truncated": rollout.truncated.cpu(),
            "sampler_logp": None if rollout.sampler_logp is None else rollout.sampler_logp.cpu(),
            "rewards": {name: value.cpu() for name, value in experience.rewards.items()},
            "reward": experience.reward.cpu(), "advantages": experience.advantages.cpu(),
            "counts": [experience.groups_drawn, experience.groups_with_signal, experience.bad_rows_skipped]}


def experience_from_state(state: dict, task: Task) -> Taken:
    """`experience_state` back: the experience (its examples made again from their indices), the
    cursor after it and its lag."""
    examples = [make_example(task, idx, "train") for idx in state["indices"]]
    rows = [example for example in examples for _ in range(state["group"])]  # a group shares its example
    rollout = Rollout(rows, state["completion_ids"], state["completion_mask"], texts=list(state["texts"]),
                      truncated=state["truncated"], sampler_logp=state["sampler_logp"])
    drawn, with_signal, skipped = state["counts"]
    experience = Experience(rollout, rewards=dict(state["rewards"]), reward=state["reward"],
                            advantages=state["advantages"], groups_drawn=drawn, groups_with_signal=with_signal,
                            bad_rows_skipped=skipped, seconds=dict.fromkeys(STEP_SECONDS, 0.0),
                            indices=list(state["indices"]))
    return experience, state["cursor"], state["lag"]


class Synchronous:
    """rollout.ahead=0: each step's rollouts made at its start, with its own weights."""

    def __init__(self, sampler: GroupSampler):
        self.sampler = sampler
        self.waited = 0.0

    @property
    def rows(self) -> RowGuard:
        return self.sampler.rows

    @property
    def reward_failure(self) -> str | None:
        return self.sampler.reward_failure

    def take(self, step: int, cursor: int) -> Taken:
        experience, next_cursor = collect_experience(self.sampler, step, cursor)
        return experience, next_cursor, 0

    def after_update(self, step: int) -> dict:
        """What is left to do once the update of `step` is made; returns `state()`, what the
        checkpoint of this step keeps."""
        return self.state()

    def state(self) -> dict:
        return {}

    def metrics(self, lag: int) -> dict[str, float]:
        """The step's metrics of the schedule: none when synchronous."""
        return {}

    def close(self) -> None:
        """Stop the sampler's prefetching worker."""
        self.sampler.close()


class OneStepAhead(Synchronous):
    """rollout.ahead=1 in each process: `take(k)` gives the rollouts made before the update of step
    k-1 (at a run's first step, its own) and makes those of step k+1 now, before the update of step k."""

    def __init__(self, sampler: GroupSampler, steps: int, carried: dict):
        super().__init__(sampler)
        self.steps = steps
        self.pending: Taken | None = experience_from_state(carried, sampler.task) if carried else None

    def take(self, step: int, cursor: int) -> Taken:
        current = self.pending or (*collect_experience(self.sampler, step, cursor), 0)
        self.pending = None
        experience, next_cursor, _ = current
        if experience is not None and step + 1 < self.steps:
            made, after = collect_experience(self.sampler, step + 1, next_cursor)  # the weights of step k
            self.pending = (made, after, 1) if made is not None else None  # None: a reward failed, the run stops
        return current

    def state(self) -> dict:
        if self.pending is None:
            return {}
        experience, cursor, lag = self.pending
        return experience_state(experience, cursor, lag)

    def metrics(self, lag: int) -> dict[str, float]:
        """rollout/lag_steps: how many updates old the weights that made the step's rollouts were."""
        return {"rollout/lag_steps": lag}


@dataclass
class Link:
    """Every process of a launch with generators, joined apart from the trainers' own process group:
    `everyone` (all ranks of the launch) carries rollouts from the generator to each trainer,
    `weights` (trainer 0 as rank 0, the generator as rank 1; None on the other trainers) the weights."""

    rank: int  # in the launch
    world: int  # processes in the launch
    generators: int
    everyone: dist.ProcessGroup
    weights: dist.ProcessGroup | None

    @property
    def trainers(self) -> int:
        return self.world - self.generators

    @property
    def generates(self) -> bool:
        return self.rank >= self.trainers

    @property
    def generator_rank(self) -> int:
        return self.trainers  # the one generator: the launch's last rank

    def send_object(self, value, to: int) -> None:
        """`value` pickled to launch rank `to` over `everyone` (its size first)."""
        data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)  # (bytes,)
        self.everyone.send([torch.tensor([data.numel()], dtype=torch.long)], to, 0).wait()
        self.everyone.send([data], to, 1).wait()

    def receive_object(self, source: int):
        """What `send_object` sent from launch rank `source` (one launch's own processes: trusted)."""
        size = torch.zeros(1, dtype=torch.long)
        self.everyone.recv([size], source, 0).wait()
        data = torch.empty(int(size), dtype=torch.uint8)  # (bytes,)
        self.everyone.recv([data], source, 1).wait()
        return pickle.loads(data.numpy().tobytes())  # noqa: S301 - sent by a process of this launch

    def broadcast_header(self, values: list[int]) -> list[int]:
        """Trainer 0's `values` (go, start step, cursor, has_pending) to the generator over `weights`."""
        header = torch.tensor(values if values else [0, 0, 0, 0], dtype=torch.long)  # (4,)
        self.broadcast(header)
        return header.tolist()

    def broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        self.weights.broadcast([tensor], options).wait()

    def broadcast_weights(self, tensors: list[torch.Tensor]) -> None:
        """`tensors` from trainer 0 into the generator's, in flat chunks of one dtype of at most
        CHUNK_BYTES (one tensor alone when larger), through host memory (gloo)."""
        sender = self.rank == 0
        chunk: list[torch.Tensor] = []

        def flush() -> None:
            flat = (torch.cat([t.detach().reshape(-1).cpu() for t in chunk]) if sender  # (elements,)
                    else torch.empty(sum(t.numel() for t in chunk), dtype=chunk[0].dtype))
            self.broadcast(flat)
            if not sender:
                offset = 0
                with torch.no_grad():
                    for t in chunk:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()
            chunk.clear()

        for tensor in tensors:
            if chunk and (tensor.dtype != chunk[0].dtype
                          or sum(t.numel() * t.element_size() for t in chunk) + tensor.numel() * tensor.element_size()
                          > CHUNK_BYTES):
                flush()
            chunk.append(tensor)
        if chunk:
            flush()


def split_launch(config: Config, env: dict) -> Link | None:
    """With rollout.generators: the launch's processes joined in a `Link`, and this process's own world
    set in `env` before accelerate reads it: the trainers' (WORLD_SIZE = trainers, ranks unchanged;
    accelerate makes their group), or the generator alone (its group of one made here). None without
    generators."""
    generators = config.rollout.generators
    if not generators:
        return None
    world = launched_world()
    if world <= generators:
        raise VlmrlError(f"rollout.generators={generators} needs a launch of at least {generators + 1} processes "
                         f"(the last generates, the others train); this one has {world}: accelerate launch "
                         "--multi_gpu --num_processes 2 (or more), or rollout.generators=0")
    if (asked := requested_strategy(env) or "").startswith("ZeRO"):  # DeepSpeed would engage in the generator too
        raise VlmrlError(f"rollout.generators={generators} runs with DDP or FSDP2 trainers, not {asked}: launch "
                         "with configs/accelerate/fsdp2.yaml (or ddp.yaml), or rollout.generators=0")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise VlmrlError("rollout.generators needs processes started by accelerate launch or torchrun (their "
                         "rendezvous store joins the generator to the trainers)")
    rank, trainers = int(env["RANK"]), world - generators
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=LINK_TIMEOUT)
    everyone = dist.ProcessGroupGloo(dist.PrefixStore("vlmrl/ahead/everyone", store), rank, world, LINK_TIMEOUT)
    weights = None
    if rank == 0 or rank >= trainers:
        weights = dist.ProcessGroupGloo(dist.PrefixStore("vlmrl/ahead/weights", store),
                                        0 if rank == 0 else rank - trainers + 1, generators + 1, LINK_TIMEOUT)
    own = trainers if rank < trainers else 1
    env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"] = str(own), str(min(own, int(env.get("LOCAL_WORLD_SIZE", own))))
    if rank >= trainers:
        env["RANK"] = "0"
        # the generator's own group of one, on keys of its own: made by accelerate, it would be the store's
        # group "0" as the trainers' is, and its gloo address written under trainer 0's key would send the
        # other trainers to it (their first collective hung). accelerate takes a group that is made.
        dist.init_process_group(store=dist.PrefixStore("vlmrl/ahead/generator", store), rank=0, world_size=1,
                                timeout=LINK_TIMEOUT)
    return Link(rank, world, generators, everyone, weights)


def share(experience: Experience, trainer: int, trainers: int) -> Experience:
    """Trainer `trainer`'s contiguous share (whole groups) of a step's experience."""
    groups = len(experience.indices)
    per = groups // trainers
    group = len(experience.rollout.rows) // max(groups, 1)
    rows = list(range(trainer * per * group, (trainer + 1) * per * group))
    return replace(experience, rollout=experience.rollout.select(rows),
                   rewards={name: value[rows] for name, value in experience.rewards.items()},
                   reward=experience.reward[rows], advantages=experience.advantages[rows],
                   groups_drawn=experience.groups_drawn // trainers,
                   groups_with_signal=experience.groups_with_signal // trainers,
                   indices=experience.indices[trainer * per:(trainer + 1) * per])


class FromGenerators:
    """A trainer's rollouts, made by the launch's generator (`run_generator`): the weights go to it at
    the start and after each update but the last two; its messages come in step order."""

    def __init__(self, session, task: Task, link: Link):
        self.session, self.link, self.steps = session, link, session.config.train.steps
        self.rows = RowGuard(task, session.processor, limit=session.config.rollout.max_prompt_length)
        self.reward_failure: str | None = None
        self.waited = 0.0  # seconds waited for the generator's rollouts this step
        self.outstanding: int | None = None  # the step whose rollouts the generator is making for this trainer
        start = session.start_step
        self.pending = experience_from_state(session.carried, task) if session.carried else None
        cursor = self.pending[1] if self.pending is not None else session.cursor
        if link.rank == 0:
            link.broadcast_header([int(start < self.steps), start, cursor, int(self.pending is not None)])
        if start < self.steps:
            self.send_weights(every=True)
            if self.pending is None:
                self.outstanding = start
                self.pending = self.receive()
            self.outstanding = start + 1 if start + 1 < self.steps else None

    def receive(self) -> Taken:
        """The next message of the generator: this trainer's share, and the problems it met."""
        started = time.perf_counter()
        message = self.link.receive_object(self.link.generator_rank)
        self.waited += time.perf_counter() - started
        self.outstanding = None
        self.rows.stop = self.rows.stop or message["bad_row"]
        self.reward_failure = self.reward_failure or message["reward_failure"]
        note_broken_rows(self.session.policy, message["broken"])
        return message["experience"], message["cursor"], message["lag"]

    def take(self, step: int, cursor: int) -> Taken:
        current, self.pending = self.pending, None
        return current

    def after_update(self, step: int) -> dict:
        """The rollouts of step `step` + 1 (made with the weights before this update), then the new
        weights to the generator when it makes a further step's; returns `state()`."""
        self.waited = 0.0
        if step + 1 < self.steps:
            self.pending = self.receive()
        if step + 2 < self.steps:
            if self.link.rank == 0:
                self.link.broadcast_header([1, step + 1, 0, 0])
            self.send_weights(every=False)
            self.outstanding = step + 2
        return self.state()

    def send_weights(self, every: bool) -> None:
        """The policy's parameters (`every` one, else the trainable ones) from trainer 0 to the generator,
        in its parameters' order. Every trainer calls this at the same point: a sharded policy (FSDP2)
        is gathered whole on each (sharding.gathered, as for generation: its parameters are then the
        full tensors), and trainer 0 alone sends them."""
        with gathered(self.session.policy) as policy:
            if self.link.rank == 0:
                self.link.broadcast_weights([p for p in policy.parameters() if every or p.requires_grad])

    def state(self) -> dict:
        if self.pending is None or self.pending[0] is None:
            return {}
        return experience_state(*self.pending)

    def metrics(self, lag: int) -> dict[str, float]:
        """rollout/lag_steps, and time/rollout_wait: the seconds this trainer waited for the generator's
        rollouts after the update."""
        return {"rollout/lag_steps": lag, "time/rollout_wait": self.waited}

    def close(self) -> None:
        """A run that ends before its last step: the message the generator is sending taken (and
        dropped), then a stop when it waits for weights, so it ends too."""
        if self.outstanding is None:
            return
        made, self.outstanding = self.outstanding, None
        try:
            self.link.receive_object(self.link.generator_rank)
            if made + 1 < self.steps and self.link.rank == 0:
                self.link.broadcast_header([0, 0, 0, 0])
        except RuntimeError:  # the generator has gone already (a launcher's SIGTERM): nothing left to take
            pass


class GeneratorSide:
    """What `GroupSampler` and `collect_experience` read of a session, in the generator: the policy
    on this process's device, the whole batch of a step (one process's view)."""

    def __init__(self, config: Config):
        self.config = config
        self.accelerator = make_accelerator(config.model.device, os.environ)  # one process (split_launch)
        self.world, self.rank, self.main = 1, 0, True
        set_seed(config.seed)
        self.policy, self.processor = load_trainable_policy(config, self.accelerator.device, None)
        freeze_unscaled_vision(self.policy, config.model.vision_lr_scale)  # the trainer's trainable set, sent each step
        self.policy.eval()

    def gathered(self, model: torch.nn.Module | None = None):
        return contextlib.nullcontext(model or self.policy)

    def any_process(self, flag: bool) -> bool:
        return flag


def run_generator(config: Config, task: Task, link: Link) -> None:
    """The generator's loop: the weights from trainer 0, then each step's rollouts made and sent to
    every trainer (its share), the weights after each update taken before the step after next."""
    side = GeneratorSide(config)
    os.environ["RANK"] = str(link.rank)  # accelerate has read its one process: the launch's rank again (the CLI's)
    sampler = GroupSampler.for_run(side, task)
    try:
        go, start, cursor, has_pending = link.broadcast_header([])
        if not go:
            return
        link.broadcast_weights(list(side.policy.parameters()))
        step, steps = start + bool(has_pending), config.train.steps
        lag = int(bool(has_pending))
        while step < steps:
            experience, cursor = made = collect_experience(sampler, step, cursor)
            for trainer in range(link.trainers):
                link.send_object({"experience": experience and share(experience, trainer, link.trainers),
                                  "cursor": made[1], "lag": lag, "bad_row": sampler.rows.stop,
                                  "reward_failure": sampler.reward_failure,
                                  "broken": take_broken_rows(side.policy) if trainer == 0 else 0}, trainer)
            if step > start or has_pending:  # the weights of the step after this one's: from trainer 0
                if step + 1 < steps:
                    go, _, _, _ = link.broadcast_header([])
                    if not go:
                        return
                    link.broadcast_weights([p for p in side.policy.parameters() if p.requires_grad])
            step, lag = step + 1, 1
    finally:
        sampler.close()


def step_rollouts(session, task: Task, link: Link | None) -> Synchronous | FromGenerators:
    """Where a trainer's rollouts come from, as rollout.ahead and rollout.generators say."""
    if link is not None:  # DDP or FSDP2 trainers (split_launch refused ZeRO-3)
        return FromGenerators(session, task, link)
    sampler = GroupSampler.for_run(session, task)
    if session.config.rollout.ahead:
        return OneStepAhead(sampler, session.config.train.steps, session.carried)
    return Synchronous(sampler)
