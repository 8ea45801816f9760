"""Per-call cost of the model tool `keypoints` (tools/keypoints_tool.py) on this CPU, on a tiny build or a folder.

Run: `OMP_NUM_THREADS=1 python benchmarks/bench_keypoints_tool.py [--arch vitpose|superpoint] [--calls 20]
[--model FOLDER] [--base]`. Without --model it builds the tiny random model of `--arch` (`vlmrl tiny-model OUT
--tool keypoints --arch ARCH`) in a temporary folder. Each call runs through `run_tool`, as the rollout runs it,
on a 448x448 census-like scene (bench_cv_tools.py's) with a 200x300 box, the tools showing 448 px. Prints the
first call (the model's load), the median and 90th percentile of `--calls` calls on different images (no cache
hit), of the same calls again (all cache hits), and one turn of 8 calls computed in one forward
(`ModelTool.prefetch`) against the same 8 computed one at a time. `--base` also times one forward of a random
ViTPose of the base size (86M parameters, 256 x 192 input: usyd-community/vitpose-base-simple's shape; random
weights cost the same).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cv_tools import census_scene, timed  # noqa: E402

BOX = [100, 60, 300, 360]
"""The box each call asks about (200 x 300: a standing person's shape)."""


def base_forward() -> float:
    """Seconds of one forward of a random base-size ViTPose on one 256x192 crop (the second of two: the first
    warms up)."""
    import torch
    from transformers import VitPoseBackboneConfig, VitPoseConfig, VitPoseForPoseEstimation

    config = VitPoseConfig(backbone_config=VitPoseBackboneConfig(out_indices=[12]), num_labels=17)
    model = VitPoseForPoseEstimation(config).eval()
    pixels = torch.randn(1, 3, 256, 192)
    with torch.inference_mode():
        for _ in range(2):
            start = time.perf_counter()
            model(pixel_values=pixels)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="vitpose", choices=("vitpose", "superpoint"))
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--model", default=None, help="a ViTPose or SuperPoint folder (default: a tiny one, built here)")
    parser.add_argument("--base", action="store_true", help="also time a base-size ViTPose's forward")
    args = parser.parse_args()
    from vlmrl.models.tool_models import build_tiny_tool_model
    from vlmrl.tools import ToolCall, ToolContext, ToolLimits, resolve_tools, run_tool

    folder = args.model or str(build_tiny_tool_model(Path(tempfile.mkdtemp()) / args.arch, "keypoints",
                                                     arch=args.arch))
    tools, limits = resolve_tools(["keypoints"], {"keypoints": folder}), ToolLimits()
    tool = tools["keypoints"]
    scenes = [census_scene(seed) for seed in range(args.calls + 8)]

    def run(scene, **arguments):
        result = run_tool(ToolCall("keypoints", arguments), tools, ToolContext([scene], max_side=448), limits)
        assert result.error is None, result.text

    start = time.perf_counter()
    run(scenes[0], box=BOX)
    first = time.perf_counter() - start
    fresh = [timed(lambda s=s: run(s, box=BOX), 1)[0] for s in scenes[1:args.calls + 1]]
    again = [timed(lambda s=s: run(s, box=BOX), 1)[0] for s in scenes[1:args.calls + 1]]
    turn = scenes[args.calls + 1:args.calls + 9]
    calls = [(ToolContext([s], max_side=448), {"box": BOX}) for s in turn]
    start = time.perf_counter()
    tool.prefetch(calls)
    for context, arguments in calls:
        tool(context, **arguments)
    batched = time.perf_counter() - start
    tool.cache.clear()
    start = time.perf_counter()
    for context, arguments in calls:
        tool(context, **arguments)
    alone = time.perf_counter() - start
    ms = lambda values: f"median {statistics.median(values):.1f} ms, p90 {sorted(values)[int(0.9 * len(values))]:.1f} ms"  # noqa: E731
    print(f"keypoints on {folder} ({args.arch if not args.model else 'given folder'}), 448x448 scenes, box {BOX}")
    print(f"first call (load + forward): {first:.2f} s")
    print(f"{len(fresh)} calls, different images: {ms(fresh)}")
    print(f"the same calls again (cache hits): {ms(again)}")
    print(f"a turn of 8 calls: one forward {batched * 1e3:.0f} ms, one at a time {alone * 1e3:.0f} ms")
    if args.base:
        print(f"base-size ViTPose (86M, 256x192), one forward: {base_forward():.2f} s")


if __name__ == "__main__":
    main()
