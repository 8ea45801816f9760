"""Per-call cost of the model tool `detect` (tools/model_tools.py) on this CPU, on the tiny OWLv2 or a folder.

Run: `OMP_NUM_THREADS=1 python benchmarks/bench_model_tools.py [--calls 20] [--model FOLDER] [--base]`.
Without --model it builds the tiny random OWLv2 (`vlmrl tiny-model OUT --tool detect`) in a temporary
folder. Each call runs through `run_tool`, as the rollout runs it, on a 448x448 census-like scene
(bench_cv_tools.py's), the tools showing 448 px. Prints the first call (the model's load), the median
and 90th percentile of `--calls` calls on different images (no cache hit), of the same calls again
(all cache hits), and one turn of 8 calls computed in one forward (`ModelTool.prefetch`) against the
same 8 computed one at a time. `--base` also times one forward of a random OWLv2 of the base size
(155M parameters, 960 x 960 input: google/owlv2-base-patch16-ensemble's shape; random weights cost
the same).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cv_tools import census_scene, timed  # noqa: E402


def base_forward() -> float:
    """Seconds of one forward of a random base-size OWLv2 on one 960x960 image and one phrase (the second
    of two: the first warms up)."""
    import torch
    from transformers import Owlv2Config, Owlv2ForObjectDetection

    model = Owlv2ForObjectDetection(Owlv2Config(vision_config={"image_size": 960})).eval()
    ids = torch.randint(1, 1000, (1, 16))
    pixels = torch.randn(1, 3, 960, 960)
    with torch.inference_mode():
        for _ in range(2):
            start = time.perf_counter()
            model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--model", default=None, help="a detector folder (default: the tiny OWLv2, built here)")
    parser.add_argument("--base", action="store_true", help="also time a base-size OWLv2's forward")
    args = parser.parse_args()
    from vlmrl.models.tool_models import build_tiny_tool_model
    from vlmrl.tools import ToolCall, ToolContext, ToolLimits, resolve_tools, run_tool

    folder = args.model or str(build_tiny_tool_model(Path(tempfile.mkdtemp()) / "owlv2", "detect"))
    tools, limits = resolve_tools(["detect"], {"detect": folder}), ToolLimits()
    detect = tools["detect"]
    scenes = [census_scene(seed) for seed in range(args.calls + 8)]

    def run(scene, **arguments):
        result = run_tool(ToolCall("detect", arguments), tools, ToolContext([scene], max_side=448), limits)
        assert result.error is None, result.text
        return result

    start = time.perf_counter()
    first = run(scenes[-1], query="red circle")
    print(f"first call (loads the model): {(time.perf_counter() - start) * 1000:.0f} ms; {first.text.splitlines()[0]}")
    print(f"{args.calls} calls each, 448x448 scene, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print("| call | median ms | p90 ms |\n|---|---|---|")
    for label in ("computed", "from the cache"):
        queue = iter(scenes[:args.calls])
        times = sorted(timed(lambda: run(next(queue), query="red circle"), args.calls))
        print(f'| `detect(query="red circle")`, {label} | {statistics.median(times):.1f} | '
              f"{times[int(0.9 * (len(times) - 1))]:.1f} |")
    turn = [(ToolContext([scene], max_side=448), {"query": "blue square"}) for scene in scenes[args.calls:]]
    start = time.perf_counter()
    detect.prefetch(turn)
    together = (time.perf_counter() - start) * 1000
    alone = type(detect)(detect.folder, cache_size=0)
    start = time.perf_counter()
    for context, arguments in turn:
        alone(context, **arguments)
    print(f"a turn of {len(turn)} calls: {together:.0f} ms in one forward, "
          f"{(time.perf_counter() - start) * 1000:.0f} ms one at a time")
    if args.base:
        print(f"base-size OWLv2 (155M parameters, 960x960): one forward {base_forward():.1f} s")


if __name__ == "__main__":
    main()
