"""The scoring phase of a judge reward: its requests in flight together against one at a time.

Run: `python benchmarks/judge_reward.py [--completions 64 --group 8 --latency 0.2 --concurrency 1,4,16,64]`

A local OpenAI-compatible server (tests/http_servers.py's LocalServer: stdlib http.server, a thread
per request) answers each `POST /v1/chat/completions` after `--latency` seconds with a chat completion
whose reply holds a score. It sleeps instead of generating: the figure is the client's (vlmrl's
`judge` reward, rewards/judge.py) latency hiding, not a model's speed, and a sleeping server answers
many requests at once as a batching server such as `vllm serve` does while it has room. For each
`--concurrency` the script scores one step's batch (`--completions` different completions of
`--completions / --group` prompts, the issue's 64 = 8 prompts x G = 8) through `score_batch`, the
trainer's own call, `--repeats` times, and prints the median seconds of the scoring phase, its ratio
to concurrency 1 (one completion at a time) and the most requests the server had in flight.
`--images` sends each prompt's image (a 112-pixel PNG data URL) with each request.
The issue's target: at 200 ms a request and 64 completions a step, the scoring phase at most 0.1x of
asking one completion at a time.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from http_servers import LocalServer, Request, json_answer  # noqa: E402


def sleeping_judge(latency_s: float):
    """An answer function: a chat completion replying `Score: 7` after `latency_s` seconds."""
    def answer(request: Request):
        time.sleep(latency_s)
        return json_answer({"object": "chat.completion", "model": request.json["model"], "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Score: 7"}, "finish_reason": "stop"}]})
    return answer


def batch(completions: int, group: int):
    """(examples, texts): `completions` different completions, `group` per prompt (one image each)."""
    from PIL import Image

    from vlmrl.tasks.base import Example

    prompts = [Example(image=Image.new("RGB", (112, 112), (30 * i % 256, 90, 160)), prompt=f"How many shapes? ({i})",
                       answer=str(i % 5), meta={"idx": i, "split": "train", "columns": {}})
               for i in range(-(-completions // group))]
    return [prompts[i // group] for i in range(completions)], [f"<answer>{i}</answer>" for i in range(completions)]


def measure(server: LocalServer, concurrency: int, args) -> tuple[float, int]:
    """(the median seconds of scoring one batch, the most requests in flight at once)."""
    from vlmrl.rewards.reward import resolve
    from vlmrl.rewards.score import score_batch

    reward = resolve("judge", kwargs={"url": server.address("/v1"), "model": "judge", "images": args.images,
                                      "template": "Question: {question}\nGold: {answer}\nAnswer: {completion}\nScore?",
                                      "score": {"regex": r"Score: (\d+)", "range": [0, 10]},
                                      "concurrency": concurrency, "timeout_s": 30, "retries": 0})
    examples, texts = batch(args.completions, args.group)
    times = []
    server.peak = 0
    for _ in range(args.repeats):
        start = time.perf_counter()
        scores = score_batch([reward], examples, texts)
        times.append(time.perf_counter() - start)
        assert scores["judge"] == [7.0] * args.completions
    return statistics.median(times), server.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--latency", type=float, default=0.2, help="seconds the server takes per request")
    parser.add_argument("--concurrency", default="1,4,16,64", help="the settings compared (1 first: the baseline)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--images", action="store_true", help="send each prompt's image with its requests")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    server = LocalServer(sleeping_judge(args.latency))
    try:
        rows = [(c, *measure(server, c, args)) for c in levels]
    finally:
        server.close()
    base = rows[0][1]
    print(f"judge reward, {args.completions} completions ({args.group} per prompt), server {args.latency * 1000:g} ms "
          f"a request (sleeping, not generating){', images sent' if args.images else ''}; median of {args.repeats}")
    print(f"command: python benchmarks/judge_reward.py {shlex.join(sys.argv[1:])}".rstrip())
    print("| concurrency | scoring phase (s) | vs concurrency " + f"{levels[0]} | most in flight |")
    print("|---|---|---|---|")
    for concurrency, seconds, peak in rows:
        print(f"| {concurrency} | {seconds:.3f} | {seconds / base:.3f}x | {peak} |")


if __name__ == "__main__":
    main()
