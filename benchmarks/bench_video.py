"""Each video once per group: vision rows and CPU time of generation and the log-prob pass on video
prompts, vlmrl's fast paths (shared prompt cache, packed groups) against the plain path (every
prompt repeated G times, as TRL does with images; TRL 1.16's GRPOTrainer takes no video column, so
the plain path stands in for it here).

    python benchmarks/bench_video.py [--model runs/small-model] [--prompts 8] [--group 8]
                                     [--frames 16] [--side 224] [--tokens 32]

Prints a Markdown table: per path, the rows the vision tower computed, the CPU seconds (user + sys of
this process, resource.getrusage) and the wall seconds, each the best of `--repeats` runs; and the
machine's load average (wall times on a shared machine are not to be trusted, CPU times less so).
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch

from vlmrl.config import GenerationSettings
from vlmrl.models import build_tiny_model, load_policy
from vlmrl.models.loading import counting_vision_rows
from vlmrl.rollout.completions import Completions
from vlmrl.rollout.generation import generate_groups
from vlmrl.rollout.prompts import encode_prompts
from vlmrl.tasks import get_task
from vlmrl.training.logprobs import LogprobScorer


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measured(work, repeats: int) -> tuple[int, float, float]:
    """(vision rows, CPU s, wall s) of `work()`, the best of `repeats` runs by CPU time."""
    best = None
    for _ in range(repeats):
        cpu, wall = cpu_seconds(), time.perf_counter()
        with counting_vision_rows(work.model) as rows:
            work()
        run = (sum(rows), cpu_seconds() - cpu, time.perf_counter() - wall)
        best = run if best is None or run[1] < best[1] else best
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder (default: build the small one)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--side", type=int, default=224)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    folder = args.model or str(build_tiny_model("runs/bench-video-model", size="small"))
    model, processor = load_policy(folder, device="cpu")
    task = get_task("motion", frames=args.frames, image_size=args.side)
    examples = [task.example(i) for i in range(args.prompts)]
    rows: dict[str, tuple[int, float, float]] = {}
    rollout = None
    for shared in (True, False):
        settings = GenerationSettings(group_size=args.group, max_new_tokens=args.tokens, temperature=1.0,
                                      share_prompt_cache=shared)

        def generate(settings=settings):
            nonlocal rollout
            with torch.no_grad():
                rollout = generate_groups(model, processor, examples, settings, seed=0)
        generate.model = model
        rows[f"generation, {'shared prompt cache' if shared else 'every prompt repeated G times'}"] = \
            measured(generate, args.repeats)
    completions = Completions(rollout.rows, rollout.completion_ids, rollout.completion_mask)
    for pack in (True, False):
        def score(pack=pack):
            model.zero_grad()
            logp, _ = LogprobScorer(processor, 1.0, pack, 1024)(model, completions)
            logp.sum().backward()
        score.model = model
        rows[f"log-probs + backward, {'packed groups' if pack else 'plain'}"] = measured(score, args.repeats)
    prompt = encode_prompts(processor, examples[:1], torch.device("cpu"))["input_ids"]  # (1, P)
    tokens = int((prompt == processor.video_token_id).sum())
    print(f"{args.prompts} prompts x G={args.group}, {args.frames} frames of {args.side}x{args.side} "
          f"({tokens} video tokens a prompt), {args.tokens} new tokens, float32, "
          f"{torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f}\n")
    print("| path | vision rows | CPU s | wall s |\n|---|---:|---:|---:|")
    for name, (vision, cpu, wall) in rows.items():
        print(f"| {name} | {vision} | {cpu:.2f} | {wall:.2f} |")


if __name__ == "__main__":
    main()
