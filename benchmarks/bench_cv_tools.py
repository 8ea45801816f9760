"""Per-call cost of the built-in tools on this CPU: find_objects and measure (tools/cv_tools.py), zoom beside.

Run: `OMP_NUM_THREADS=1 python benchmarks/bench_cv_tools.py [--calls 50]`. The scene is 448x448 white
with 60 small discs and squares (radius 7 px, six colours, some touching: the census-like case);
each call runs through `run_tool`, as the rollout runs it, with the tools showing 448 px. Prints the
median and the 90th percentile of `--calls` calls of each, in milliseconds. OpenCV's own threads are
set to OMP_NUM_THREADS (default 1). The first call of a process also imports OpenCV (about 0.2 s);
it is timed apart. The tools' answer caches are emptied before each call: every call is computed
(benchmarks/tool_costs.py times the cache's hits).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from PIL import Image, ImageDraw


def census_scene(seed: int = 0, count: int = 60, side: int = 448) -> Image.Image:
    """`count` discs and squares of radius 7 in the six chromatic colours, a quarter of them touching
    the one before."""
    from vlmrl.tasks.shapes import RGB

    rng = random.Random(seed)
    image = Image.new("RGB", (side, side), "white")
    draw = ImageDraw.Draw(image)
    x, y = 20, 20
    for k in range(count):
        if k % 4 != 3:  # a new place; every fourth touches the previous shape
            x, y = rng.randrange(10, side - 24), rng.randrange(10, side - 24)
        else:
            x += 14
        colour = RGB[("red", "green", "blue", "yellow", "purple", "orange")[k % 6]]
        shape = draw.ellipse if k % 3 else draw.rectangle
        shape((x, y, x + 13, y + 13), fill=colour)
    return image


def timed(function, calls: int) -> list[float]:
    """Milliseconds of each of `calls` calls of `function`."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    from vlmrl.tools import ToolCall, ToolContext, ToolLimits, resolve_tools, run_tool

    tools, limits = resolve_tools(["find_objects", "measure", "zoom"]), ToolLimits()
    context = ToolContext([census_scene()], max_side=448)

    def run(name: str, **arguments):
        tools["find_objects"].answer_cache.clear()  # every call computed (the same call repeats: tools/cache.py)
        tools["measure"].answer_cache.clear()
        result = run_tool(ToolCall(name, arguments), tools, context, limits)
        assert result.error is None, result.text
        return result

    start = time.perf_counter()
    first = run("find_objects")
    print(f"first call (imports OpenCV): {(time.perf_counter() - start) * 1000:.0f} ms; "
          f"{first.text.splitlines()[0]}")
    import cv2

    cv2.setNumThreads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cases = {
        "find_objects() (all colours, whole image)": lambda: run("find_objects"),
        'find_objects(colour="blue")': lambda: run("find_objects", colour="blue"),
        'find_objects(colour="blue", box=[0, 0, 224, 224])': lambda: run("find_objects", colour="blue", box=[0, 0, 224, 224]),
        'measure(ids=[1, 2], colour="blue")': lambda: run("measure", ids=[1, 2], colour="blue"),
        'measure(colour="blue") (area statistics)': lambda: run("measure", colour="blue"),
        'measure(boxes=[[0, 0, 50, 50], [100, 100, 200, 150]])': lambda: run("measure", boxes=[[0, 0, 50, 50], [100, 100, 200, 150]]),
        "zoom(box=[100, 100, 212, 212]) (for comparison)": lambda: run("zoom", box=[100, 100, 212, 212]),
    }
    print(f"{args.calls} calls each, 448x448 scene, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print("| call | median ms | p90 ms |\n|---|---|---|")
    for name, function in cases.items():
        times = sorted(timed(function, args.calls))
        print(f"| `{name}` | {statistics.median(times):.1f} | {times[int(0.9 * (len(times) - 1))]:.1f} |")


if __name__ == "__main__":
    main()
