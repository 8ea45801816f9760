"""One step's experience: grouped completions, every reward component, and the advantages.

Prompts are drawn in order from the task's train split, from the data cursor (the index of the
next train prompt); each process takes its own contiguous share of every global batch, so a group
never straddles processes. Each generate call is seeded from (seed, step, first prompt index), so
the samples do not depend on how many processes there are, nor on whether the run was resumed.
Under DAPO dynamic sampling, groups whose rewards are all equal are set aside and further batches
drawn, for at most `max_sampling_rounds` rounds (all processes draw the same number of rounds); a
batch still short is filled with set-aside groups, which carry no policy gradient. Advantages are
computed over the whole batch of all processes (grpo.group_advantages), then each keeps its rows.
With `rollout.tools`, each completion is a multi-turn trajectory in which the model calls visual
tools (tool_rollout.py); the rest of the step is the same. A bad example met mid-run (one the task
cannot make, whose image the processor refuses, or whose prompt is longer than
rollout.max_prompt_length) follows the task's on_bad_row (safety/bad_rows.py). With
`train.prefetch_batches` > 0 the next calls' examples are made and encoded on a worker thread while
the model works (prefetch.py): the same examples, the same tensors; `seconds["data"]` is what the
trainer still spent on them (drawing and encoding itself, or waiting for the worker) and
`seconds["data_ahead"]` the worker's time on the calls it took, hidden behind the model's. With
`train.background_scoring` the rewards that wait on another program (a service, a judge, the reward
worker) score each call's completions on background threads while the next call generates
(background_scoring.py): the same scores; `seconds["score"]` is the scoring left on the step's path
(the rewards of the trainer's thread, the wait for the last calls' answers) and
`seconds["score_ahead"]` each call's background scoring, hidden behind generation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from vlmrl import grpo
from vlmrl.config import Config
from vlmrl.errors import VlmrlError
from vlmrl.models.support import shared_prefill_unsupported
from vlmrl.rollout.generation import Rollout, generate_groups
from vlmrl.rollout.prompts import Encoded, encode_prompts
from vlmrl.rewards.reward import Reward, build_rewards
from vlmrl.rewards.score import RewardError
from vlmrl.rollout.tool_rollout import CacheCounts, ToolBox, added_counts, generate_trajectories
from vlmrl.safety.bad_rows import RowGuard
from vlmrl.seeds import derive_seed
from vlmrl.tasks import Example, Task
from vlmrl.training.background_scoring import ChunkScorer, Scoring
from vlmrl.training.prefetch import Prefetcher


STEP_SECONDS = ("data", "generate", "score", "data_ahead", "score_ahead")
"""The wall times a step's experience keeps (`Experience.seconds`)."""


@dataclass
class Experience:
    """N = groups x G scored completions of one process, ready for the loss."""

    rollout: Rollout
    rewards: dict[str, torch.Tensor]  # component name -> (N,), as the task scored it
    reward: torch.Tensor  # (N,) what the advantages come from: total (+ overlong penalty)
    advantages: torch.Tensor  # (N,)
    groups_drawn: int  # groups generated this step, on this process
    groups_with_signal: int  # of those, groups whose rewards were not all equal
    bad_rows_skipped: int = 0  # bad train examples replaced by the next good one this step, on this process
    seconds: dict[str, float] = field(default_factory=dict)  # STEP_SECONDS: wall time, this process
    tool_cache: CacheCounts = field(default_factory=dict)  # cached tool -> (calls, computed) this step, this process
    indices: list[int] = field(default_factory=list)  # (groups,) the train example index each group answers


@dataclass
class ScoredGroup:
    """One prompt's G completions, every reward component, and the reward the advantages use."""

    rollout: Rollout
    scores: dict[str, torch.Tensor]  # component name -> (G,)
    reward: torch.Tensor  # (G,) total (+ overlong penalty)
    index: int = -1  # the train example it answers (a bad one replaced: the one used)

    @property
    def has_signal(self) -> bool:
        """Whether the rewards differ within the group (else every advantage is 0)."""
        return bool(grpo.dynamic_sampling_mask(self.reward, len(self.reward))[0])


def shaped_reward(total: torch.Tensor, rollout: Rollout, config: Config) -> torch.Tensor:
    """(N,) the task's total, plus DAPO's soft overlong penalty when enabled."""
    algo = config.algorithm
    if algo.overlong_buffer <= 0:
        return total
    penalty = grpo.overlong_penalty(rollout.lengths.cpu(), config.rollout.max_new_tokens,
                                    algo.overlong_buffer, algo.overlong_penalty)  # (N,)
    return total + penalty


@dataclass
class GroupSampler:
    """Draws this process's prompts, samples G completions each (single-turn, or trajectories with
    tools) and scores them; keeps the wall time it spent."""

    session: object  # a TrainingSession
    task: Task
    rows: RowGuard
    rewards: list[Reward]  # the run's rewards list resolved (rewards/reward.py)
    scorer: ChunkScorer  # scores each generate call, in the background where train.background_scoring says
    toolbox: ToolBox | None = None  # rollout.tools resolved (tool_rollout.py); None: single-turn
    prefetcher: Prefetcher | None = None  # train.prefetch_batches > 0: the next calls made ahead (prefetch.py)
    encodes: bool = False  # whether generation takes the prompts encoded once per group (the shared prefill)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_SECONDS, 0.0))
    replaced: int = 0  # bad examples replaced since the step began
    reward_failure: str | None = None  # the first reward failure of the step (the run stops on it)
    tool_cache: CacheCounts = field(default_factory=dict)  # cached tool -> (calls, computed) since the step began

    @classmethod
    def for_run(cls, session, task: Task) -> GroupSampler:
        """The sampler of a run, with its tools (early_checks.py refused a bad tool name before loading)."""
        settings, depth = session.config.rollout, session.config.train.prefetch_batches
        encodes = (settings.share_prompt_cache and settings.group_size > 1 and not settings.tools
                   and shared_prefill_unsupported(session.policy) is None)
        rows = RowGuard(task, session.processor, limit=settings.max_prompt_length)
        rewards = build_rewards(session.config.rewards, task)
        toolbox = ToolBox.from_config(settings) if settings.tools else None
        # the threads last: a reward or tool that cannot be built leaves no thread behind
        scorer = ChunkScorer(rewards, session.config.algorithm.reward_aggregation, settings.group_size,
                             session.config.train.background_scoring)
        prefetcher = Prefetcher(task, session.processor, settings.max_prompt_length, encodes, depth) if depth else None
        return cls(session, task, rows, rewards, scorer, toolbox, prefetcher, encodes)

    def close(self) -> None:
        """Stop the prefetching worker, if any, and the scoring threads."""
        self.scorer.close()
        if self.prefetcher is not None:
            self.prefetcher.close()

    def layout(self) -> tuple[int, int, int]:
        """(prompts per process, per generate call, per step): what says which calls come next."""
        settings, world = self.session.config.rollout, self.session.world
        return settings.per_process(world), settings.per_call(world), settings.prompts_per_step

    def draw(self, indices: list[int], first: int) -> tuple[list[int], list[Example]]:
        """The examples at `indices` (of the round starting at `first`), from the prefetching worker
        when it made them all and none is a known bad row, else drawn here (`rows.draw`, bad ones
        replaced); `Encoded` when generation takes them so. (indices used, examples)."""
        started = time.perf_counter()
        prepared, _ = self.prefetcher.take(indices, first, self.layout()) if self.prefetcher else (None, 0.0)
        if prepared is not None and prepared.error is None and not self.rows.bad.keys() & set(indices):
            used, examples = indices, prepared.examples
            if prepared.prompt is not None:
                examples = Encoded(examples, prepared.prompt)
            self.seconds["data_ahead"] += prepared.seconds
        else:
            used, examples = self.rows.draw(indices)
            if self.encodes:
                processor, limit = self.session.processor, self.session.config.rollout.max_prompt_length
                try:
                    examples = Encoded(examples, encode_prompts(processor, examples, torch.device("cpu"), limit))
                except Exception:  # noqa: BLE001 - a bad row: generation encodes them again and meets it (bad_rows.py)
                    pass
        self.seconds["data"] += time.perf_counter() - started
        return used, examples

    def generate(self, examples: list[Example], seed: int) -> Rollout:
        """G completions (or trajectories) of each example, rows grouped by example."""
        policy, processor, settings = self.session.policy, self.session.processor, self.session.config.rollout
        with self.session.gathered():  # sharded (FSDP2, ZeRO-3): once for the whole call
            if self.toolbox is None:
                return generate_groups(policy, processor, examples, settings, seed=seed)
            return generate_trajectories(policy, processor, examples, self.toolbox, seed=seed)

    def draw_and_generate(self, indices: list[int], seed: int,
                          first: int) -> tuple[list[int], list[Example], Rollout]:
        """The examples at `indices` (bad ones replaced, bad_rows.py; `first`: their round's first
        prompt): the indices used, the examples and their completions."""
        used, examples = self.draw(indices, first)
        try:
            rollout = self.generate(examples, seed)
        except VlmrlError:
            raise
        except Exception as error:  # noqa: BLE001 - a bad image the processor refuses; else re-raised
            used, examples = self.rows.after_encoding_failure(used, examples, error)
            rollout = self.generate(examples, seed)
        self.replaced += sum(u != i for u, i in zip(used, indices))
        return used, examples, rollout

    def score(self, scoring: Scoring, rollout: Rollout) -> dict[str, torch.Tensor]:
        """Every reward component of the rollout and its total, (B*G,) each; after a reward failure
        (kept in `reward_failure`: the trainer stops on it after the step's rollouts) a total of zeros."""
        try:
            return self.scorer.result(scoring, len(rollout.texts))
        except RewardError as error:
            self.reward_failure = self.reward_failure or str(error)
            return {"total": torch.zeros(len(rollout.texts))}

    def round(self, step: int, first: int) -> list[ScoredGroup]:
        """Generate and score this process's share of one round: prompts `first`, `first` + 1, ...;
        each call's scoring begun when its completions are ready, taken in order at the round's end."""
        config = self.session.config
        per_call, group = config.rollout.per_call(self.session.world), config.rollout.group_size
        calls = []
        for start in range(first, first + config.rollout.per_process(self.session.world), per_call):
            started, data = time.perf_counter(), self.seconds["data"]
            used, examples, rollout = self.draw_and_generate(list(range(start, start + per_call)),
                                                             derive_seed(config.seed, step, start), first)
            scored = time.perf_counter()
            calls.append((used, examples, rollout, self.scorer.submit(rollout)))
            self.seconds["generate"] += scored - started - (self.seconds["data"] - data)
            self.seconds["score"] += time.perf_counter() - scored
            self.tool_cache = added_counts(self.tool_cache, getattr(rollout, "cache_counts", {}))
        groups = []
        for used, examples, rollout, scoring in calls:
            waited = time.perf_counter()
            scores = self.score(scoring, rollout)  # name -> (B*G,)
            self.seconds["score"] += time.perf_counter() - waited
            self.seconds["score_ahead"] += self.scorer.ahead(scoring)
            reward = shaped_reward(scores["total"], rollout, config)  # (B*G,)
            for g in range(len(examples)):
                rows = list(range(g * group, (g + 1) * group))
                groups.append(ScoredGroup(rollout.select(rows), {k: v[rows] for k, v in scores.items()}, reward[rows],
                                          used[g]))
        return groups


def batch_advantages(session, reward: torch.Tensor) -> torch.Tensor:
    """(N,) this process's advantages, computed over the rewards of every process's batch."""
    algo, group = session.config.algorithm, session.config.rollout.group_size
    everyone = session.accelerator.gather(reward.to(session.accelerator.device)).cpu()  # (N * processes,)
    advantages = grpo.group_advantages(everyone, group, scale=algo.advantage_scale)  # (N * processes,)
    advantages = grpo.shape_advantages(advantages, group, algo.advantage_shaping)
    return advantages[session.rank * len(reward):(session.rank + 1) * len(reward)]  # (N,)


def collect_experience(sampler: GroupSampler, step: int, cursor: int) -> tuple[Experience | None, int]:
    """Generate, score and weigh this process's share of step `step`, drawing train prompts from
    `cursor` on; returns the experience and the cursor after it (None and `cursor` when a reward
    failed on any process: `sampler.reward_failure`)."""
    session = sampler.session
    settings, algo = session.config.rollout, session.config.algorithm
    per_process = settings.per_process(session.world)
    with_signal: list[ScoredGroup] = []
    without_signal: list[ScoredGroup] = []
    sampler.seconds = dict.fromkeys(STEP_SECONDS, 0.0)
    sampler.replaced, sampler.reward_failure, sampler.tool_cache = 0, None, {}
    rounds = 0
    while True:
        first = cursor + rounds * settings.prompts_per_step + session.rank * per_process
        for group in sampler.round(step, first):
            (with_signal if group.has_signal or not algo.dynamic_sampling else without_signal).append(group)
        rounds += 1
        short = algo.dynamic_sampling and len(with_signal) < per_process
        if not session.any_process(short and rounds < algo.max_sampling_rounds):
            break
    if session.any_process(sampler.reward_failure is not None):
        return None, cursor  # the trainer stops (session.stop_at_reward_failure)
    kept = (with_signal + without_signal)[:per_process]
    rollout = type(kept[0].rollout).concat([g.rollout for g in kept], session.processor.tokenizer.pad_token_id)
    reward = torch.cat([g.reward for g in kept])  # (N,)
    experience = Experience(
        rollout, rewards={name: torch.cat([g.scores[name] for g in kept]) for name in kept[0].scores},
        reward=reward, advantages=batch_advantages(session, reward),
        groups_drawn=rounds * per_process,
        groups_with_signal=sum(g.has_signal for g in with_signal + without_signal),
        bad_rows_skipped=sampler.replaced, seconds=dict(sampler.seconds), tool_cache=dict(sampler.tool_cache),
        indices=[g.index for g in kept])
    return experience, cursor + rounds * settings.prompts_per_step
