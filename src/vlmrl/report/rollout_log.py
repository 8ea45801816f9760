"""The rollout log: what the model wrote, for people to read (`vlmrl report` pages through it).

Every `train.log_rollouts_every` steps the trainer writes `rollouts/step_XXXXXX.jsonl`, one row per
completion: step, group (the prompt's index within the step), the example it came from (`trace_of`:
split and idx, and for rows of a data file also row, source_split and the data's id), image (a path relative to
`rollouts/`; the first image, else the first video) and images (all of the prompt's, in order), prompt, answer,
completion, rewards (every component), advantage, truncated, length; for multi-turn rollouts with
tools also turns: [{role, text, images}] (the model's turns and the tools' results, images stored
like the prompt's).
Each distinct image is stored once, as `rollouts/images/<content hash>.png`, however many
completions and steps show it; an image in a mode PNG cannot hold (F, CMYK, YCbCr, ...) is stored
as RGB. A prompt's videos are stored the same way as animated GIFs (`videos`: their paths, each
frame held until the next one's time); a prompt with videos and no image shows its first video
as its `image`, which a browser plays.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from PIL import Image

from vlmrl.disk import writing


ID_COLUMNS = ("id", "uid", "idx")
"""The data's own id column, the first of these a row has (exact names; a mapped column is not one):
carried as `id` into rollout logs, eval records and the report's viewer."""
PNG_MODES = ("1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA")
"""Image modes a PNG holds as they are; others are stored as RGB."""


def trace_of(example) -> dict[str, Any]:
    """Where an example comes from, to find it again: {split, idx} (`task.example(idx, split)` makes it
    again), and for a row of a data file (the dataset task) row and source_split (the row of the
    data's split it was read from) and id (the row's `ID_COLUMNS` value, when it has one)."""
    meta = example.meta if isinstance(example.meta, Mapping) else {}
    trace = {"split": meta.get("split"), "idx": meta.get("idx")}
    if "row" in meta:
        trace |= {"row": meta["row"], "source_split": meta.get("source_split")}
    columns = meta.get("columns") if isinstance(meta.get("columns"), Mapping) else {}
    name = next((name for name in ID_COLUMNS if columns.get(name) is not None), None)
    if name is not None:
        value = columns[name]
        trace["id"] = value if isinstance(value, (str, int, float, bool)) else str(value)
    return trace


def store_image(folder: Path, image: Image.Image) -> str:
    """Save `image` under folder/images/ named by its content hash (once), as RGB when PNG cannot hold
    its mode; returns the relative path."""
    digest = hashlib.sha1(image.tobytes() + repr((image.mode, image.size)).encode()).hexdigest()[:16]
    relative = f"images/{digest}.png"
    path = folder / relative
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        (image if image.mode in PNG_MODES else image.convert("RGB")).save(path)
    return relative


def store_video(folder: Path, video) -> str:
    """Save a `vlmrl.tasks.Video` under folder/images/ as an animated GIF named by the hash of its
    frames and times (once); returns the relative path."""
    content = b"".join(frame.tobytes() for frame in video.frames) + repr((video.frames[0].size, video.timestamps)).encode()
    relative = f"images/{hashlib.sha1(content).hexdigest()[:16]}.gif"
    path = folder / relative
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        gaps = [b - a for a, b in zip(video.timestamps, video.timestamps[1:])] or [1.0]
        first, *rest = video.frames
        first.save(path, format="GIF", save_all=True, append_images=rest, loop=0,
                   duration=[max(20, round(1000 * gap)) for gap in gaps + gaps[-1:]])
    return relative


def rollout_rows(step: int, experience, group_size: int, first_group: int = 0) -> list[dict]:
    """One row per completion of `experience` (its rollout, rewards and advantages), its groups
    numbered from `first_group` (a process's offset in the step; a reward that did not apply: None); images stay PIL images until
    `write_rollouts` stores them."""
    rollout, rewards, advantages = experience.rollout, experience.rewards, experience.advantages
    lengths = rollout.lengths
    return [{"step": step, "group": first_group + i // group_size, **trace_of(example), "image": example.image,
             "images": list(example.images), "videos": list(example.videos), "prompt": example.prompt,
             "answer": example.answer, "completion": text,
             "rewards": {name: None if values[i].isnan() else float(values[i]) for name, values in rewards.items()},
             "advantage": float(advantages[i]), "truncated": bool(rollout.truncated[i]),
             "length": int(lengths[i]), **turns_of(rollout, i)}
            for i, (example, text) in enumerate(zip(rollout.rows, rollout.texts))]


def turns_of(rollout, i: int) -> dict:
    """{"turns": [...]} of row i of a multi-turn rollout, else {}."""
    trajectories = getattr(rollout, "trajectories", None)
    if trajectories is None:
        return {}
    return {"turns": [{"role": t.role, "text": t.text, "images": list(t.images)} for t in trajectories[i].turns]}


def shown(folder: Path, row: dict) -> str | None:
    """The path of what a row shows first: its first image, else its first video, else None."""
    if row["image"] is not None:
        return store_image(folder, row["image"])
    return store_video(folder, row["videos"][0]) if row.get("videos") else None


def write_rollouts(run_dir: Path, step: int, rows: list[dict]) -> Path:
    """Write rollouts/step_XXXXXX.jsonl from `rollout_rows` of every process (images stored once)."""
    folder = Path(run_dir) / "rollouts"
    path = folder / f"step_{step:06d}.jsonl"
    with writing("rollouts", path):
        folder.mkdir(parents=True, exist_ok=True)
        lines = [{**row, "image": shown(folder, row),
                  "images": [store_image(folder, image) for image in row["images"]],
                  "videos": [store_video(folder, video) for video in row.get("videos", [])],
                  **({"turns": [{**turn, "images": [store_image(folder, image) for image in turn["images"]]}
                                for turn in row["turns"]]} if "turns" in row else {})} for row in rows]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path
