"""A step's rewards scored beside generation (`train.background_scoring`).

Generation runs in calls of `rollout.generation_batch_size` prompts. When a call's completions are
ready, the rewards that wait on another program are handed to background threads and the next call
generates while they answer: a reward service or a judge (each call on a thread of a pool of
SERVICE_CALLS_IN_FLIGHT, so a step's calls to a service go out together instead of one after the
other) and a function of your own that runs in the reward worker (one thread, the calls in the
order of the generate calls, as before). The rewards that run in the trainer's own thread (the
built-ins, `task`, a function of your own contained in the process: it needs the main thread for
its time limit, and puts torch's settings back around its call) are called there, as soon as the
call's completions are ready, as before. At the round's end the trainer takes each call's scores in
order (`ChunkScorer.result`), waiting for the ones still out: the step waits only for what the
last calls' scoring has left.

Every number is the one of scoring each call in turn: each reward gets the same keywords (copies
of its own: score.own_copy), the components are combined in the rewards' order (score.components_of),
and a failure is the one scoring in turn meets first: the first failing reward of the list in the
first failing call (a reward after a failing one of the trainer's thread is not called, as before).
`seconds` (on the step's path: the trainer-thread rewards and the wait) and `ahead` (each call's
background scoring, from its hand-off to its last answer: hidden while the model generated).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from vlmrl.rewards.reward import IN_WORKER, SERVICE, Reward
from vlmrl.rewards.score import RewardError, batch_keywords, call_reward, components_of
from vlmrl.rollout.generation import Rollout
from vlmrl.rollout.scoring import score_tensors, scored_inputs

SERVICE_CALLS_IN_FLIGHT = 8
"""Most calls to the run's reward services (and judges) out at once on a process: a step of 8
generate calls has each call's request out while the next generates. A judge's own requests within
a call are bounded by its `concurrency` (over all its calls at once)."""


@dataclass
class Scoring:
    """One generate call's completions being scored: each reward's answers (by its index in the
    list), a Future where a background thread gives them, or the RewardError it raised."""

    examples: list
    texts: list[str]
    answers: dict[int, list | Future | RewardError] = field(default_factory=dict)
    handed: float = 0.0  # time.perf_counter() when the background rewards were handed off
    ended: list[float] = field(default_factory=list)  # when each background answer came


class ChunkScorer:
    """Scores a run's generate calls, the background rewards on threads (`background`), the others here."""

    def __init__(self, rewards: list[Reward], aggregation: str, group_size: int, background: bool):
        self.rewards, self.aggregation, self.group_size = rewards, aggregation, group_size
        runs = {reward.runs for reward in rewards} if background else set()
        # threads only for the places the run's rewards run in; none without background scoring
        self.lanes = {place: ThreadPoolExecutor(workers, thread_name_prefix=f"vlmrl-score-{place}")
                      for place, workers in ((SERVICE, SERVICE_CALLS_IN_FLIGHT), (IN_WORKER, 1)) if place in runs}

    def close(self) -> None:
        """Let the threads go once the calls they are on end; drop the calls not begun."""
        for lane in self.lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)

    def submit(self, rollout: Rollout) -> Scoring:
        """Begin scoring a call's completions: the background rewards handed off, then the others
        called here, in the list's order (none after one that failed)."""
        examples, texts, trajectories, ids = scored_inputs(rollout)
        unknown = [None] * len(texts)
        keywords = batch_keywords(examples, texts, trajectories if trajectories is not None else unknown,
                                  ids if ids is not None else unknown)
        scoring = Scoring(examples, texts, handed=time.perf_counter())
        for i, reward in enumerate(self.rewards):
            lane = self.lanes.get(reward.runs)
            if lane is not None:
                scoring.answers[i] = lane.submit(self._timed, scoring, reward, keywords)
        for i, reward in enumerate(self.rewards):
            if i not in scoring.answers:
                try:
                    scoring.answers[i] = call_reward(reward, keywords, examples, texts)
                except RewardError as error:
                    scoring.answers[i] = error
                    break
        return scoring

    @staticmethod
    def _timed(scoring: Scoring, reward: Reward, keywords: dict[str, list]) -> list:
        try:
            return call_reward(reward, keywords, scoring.examples, scoring.texts)
        finally:
            scoring.ended.append(time.perf_counter())

    def result(self, scoring: Scoring, rows: int) -> dict[str, torch.Tensor]:
        """Every component and the total of the call's `rows` completions, (rows,) each, once every
        answer is in; RewardError: the first failing reward of the list."""
        answers = {}
        for i, reward in enumerate(self.rewards):
            answer = scoring.answers[i]  # present: rewards after a failing one here come after its error
            if isinstance(answer, Future):
                answer = answer.result()  # raises the background call's RewardError
            if isinstance(answer, RewardError):
                raise answer
            answers[reward.name] = answer
        components = components_of(self.rewards, answers, scoring.examples, scoring.texts)
        return score_tensors(self.rewards, components, self.aggregation, self.group_size or rows)

    @staticmethod
    def ahead(scoring: Scoring) -> float:
        """Seconds the call's background scoring took, from its hand-off to its last answer (0: none)."""
        return max(scoring.ended) - scoring.handed if scoring.ended else 0.0
