"""Rewards scored beside generation (issue 54, item 1): a slow reward service with and without
`train.background_scoring`, side by side in one run.

A local reward service (a threading HTTP server on the loopback, as tests/http_servers.py) pays each
completion a small length bonus, and answers each call after --latency seconds; a second one answers
at once. Four GRPO runs of the same seed on the shapes demo's settings (`vlmrl demo`'s shapes preset:
its task parameters, 8 prompts x 8 completions, DAPO-style; the small model, random weights) with
generation in calls of --per-call prompts (rollout.generation_batch_size), rewards `[task, service]`:

- instant service, in turn (`train.background_scoring=false`) and in the background (`true`);
- slow service, in turn and in the background.

The step's extra time over the instant service is the slow service's cost on the step's path: in
turn, each generate call's request waits for its answer before the next call generates (calls x
latency); in the background, the requests go out as their calls finish and the step waits only for
the last one's (one latency). Per run: the mean over steps 2.. of the step's wall time, `time/score`
(scoring left on the step's path), `time/score_ahead` (the background scoring, hidden) and
`time/generate`; and whether the slow runs' losses and rewards are equal (they must be).

    OMP_NUM_THREADS=1 python benchmarks/overlap_scoring.py [--latency 0.2 --per-call 2 --steps 5]
        [--size small] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TIMING = ("seconds", "tokens_per_s", "time/")
KEYS = ("seconds", "time/generate", "time/score", "time/score_ahead")


class Service:
    """A reward service on 127.0.0.1 answering after `latency` s: 0.1 x min(characters, 40) / 40 per
    completion; counts the calls it had in flight at once (`peak`)."""

    def __init__(self, latency: float):
        self.in_flight = self.peak = self.calls = 0
        lock, outer = threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                batch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    outer.calls += 1
                    outer.in_flight += 1
                    outer.peak = max(outer.peak, outer.in_flight)
                time.sleep(latency)
                with lock:
                    outer.in_flight -= 1
                texts = [c[0]["content"] for c in batch["completions"]]
                body = json.dumps({"rewards": [0.1 * min(len(t), 40) / 40 for t in texts]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def run(name: str, background: bool, service: Service, work: Path, model: Path, args) -> list[dict]:
    """One GRPO run on the shapes demo's settings; its metrics rows."""
    from vlmrl.config import load_config
    from vlmrl.demo import GRPO_8X8, PRESETS
    from vlmrl.report.tracking import read_metrics
    from vlmrl.training.trainer import train

    preset = PRESETS["shapes"]
    rewards = json.dumps(["task", {"name": service.url, "label": "service", "kwargs": {"retries": 0}}])
    overrides = [f"model.name_or_path={model}", "model.device=cpu", f"output_dir={work / name}", *preset.shared,
                 *GRPO_8X8, f"rollout.max_new_tokens={preset.max_new_tokens}", "train.lr=1e-4",
                 "train.micro_batch_size=64", f"rollout.generation_batch_size={args.per_call}",
                 f"train.steps={args.steps}", "train.save_every=0", "train.log_rollouts_every=0", "train.trackers=[]",
                 "eval.every=0", "train.prefetch_batches=1", f"rewards={rewards}",
                 f"train.background_scoring={str(background).lower()}"]
    return read_metrics(train(load_config(None, overrides)) / "metrics.jsonl")


def mean_after_first(rows: list[dict], key: str) -> float:
    return statistics.fmean(row[key] for row in rows[1:])


def report(args, results: dict[tuple[str, bool], list[dict]], peaks: dict, wall: float) -> list[str]:
    calls = 8 // args.per_call
    lines = [f"`OMP_NUM_THREADS=1 python benchmarks/overlap_scoring.py --latency {args.latency} --per-call "
             f"{args.per_call} --steps {args.steps} --size {args.size}`", "",
             f"The shapes demo's GRPO settings (8 prompts x 8 completions, 40 new tokens, the {args.size} model), "
             f"{args.per_call} prompts per generate call ({calls} calls a step), rewards `[task, service]`; mean over "
             f"steps 2-{args.steps} (s); load average before: {args.load}:", "",
             "| service | scoring | " + " | ".join(f"`{key}`" for key in KEYS) + " | calls in flight at once |",
             "|---" * (len(KEYS) + 3) + "|"]
    for (service, background), rows in results.items():
        lines.append(f"| {service} | {'background' if background else 'in turn'} | "
                     + " | ".join(f"{mean_after_first(rows, key):.3f}" for key in KEYS)
                     + f" | {peaks[(service, background)]} |")
    extra = {(key, background): mean_after_first(results[("slow", background)], key)
             - mean_after_first(results[("instant", background)], key)
             for key in ("seconds", "time/score") for background in (False, True)}
    strip = lambda rows: [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in rows]
    same = strip(results[("slow", True)]) == strip(results[("slow", False)])
    latency = extra[("time/score", False)] / calls  # one call's latency as measured: the answer's wait and HTTP
    met = "met" if extra[("time/score", True)] <= latency else "missed"
    lines += ["", f"the {args.latency:g} s service's extra time on the step's path over the instant one "
              f"(`time/score`): in turn {extra[('time/score', False)]:.3f} s ({calls} calls, {latency:.3f} s each), in "
              f"the background {extra[('time/score', True)]:.3f} s (target: at most one call's latency, {latency:.3f} s: "
              f"{met}); the step's wall time, extra: in turn "
              f"{extra[('seconds', False)]:.3f} s, in the background {extra[('seconds', True)]:.3f} s (the other "
              f"programs on this machine move it by more than the latency); every loss, reward and metric but the "
              f"clocks equal in the two slow runs: {same}; load average after: {args.load_after}; {wall:.0f} s in all"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--per-call", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--size", default="small")
    parser.add_argument("--results", type=Path, help="append the table to this markdown file")
    parser.add_argument("--rows", type=Path, help="write every run's metrics rows to this JSON file")
    args = parser.parse_args()

    from vlmrl.models import build_tiny_model

    args.load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    started = time.perf_counter()
    results, peaks = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        model = build_tiny_model(work / "model", size=args.size)
        for service_name, latency in (("instant", 0.0), ("slow", args.latency)):
            for background in (False, True):
                service = Service(latency)
                try:
                    results[(service_name, background)] = run(f"{service_name}_{background}", background, service,
                                                              work, model, args)
                finally:
                    service.close()
                peaks[(service_name, background)] = service.peak
    args.load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = report(args, results, peaks, time.perf_counter() - started)
    if args.rows:
        args.rows.write_text(json.dumps({f"{name}_{background}": {"rows": rows, "peak": peaks[(name, background)]}
                                         for (name, background), rows in results.items()}))
    print("\n".join(lines))
    if args.results:
        with open(args.results, "a") as out:
            out.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
