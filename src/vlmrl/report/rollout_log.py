"""The rollout log: what the model wrote, for people to read (`vlmrl report` pages through it).

Every `train.log_rollouts_every` steps the trainer writes `rollouts/step_XXXXXX.jsonl`, one row per
completion: step, group (the prompt's index within the step), image (a path relative to
`rollouts/`; the first image) and images (all of the prompt's, in order), prompt, answer,
completion, rewards (every component), advantage, truncated, length; for multi-turn rollouts with
tools also turns: [{role, text, images}] (the model's turns and the tools' results, images stored
like the prompt's).
Each distinct image is stored once, as `rollouts/images/<content hash>.png`, however many
completions and steps show it; an image in a mode PNG cannot hold (F, CMYK, YCbCr, ...) is stored
as RGB.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from PIL import Image

from vlmrl.disk import writing


PNG_MODES = ("1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA")
"""Image modes a PNG holds as they are; others are stored as RGB."""


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


def rollout_rows(step: int, experience, group_size: int, first_group: int = 0) -> list[dict]:
    """One row per completion of `experience` (its rollout, rewards and advantages), its groups
    numbered from `first_group` (a process's offset in the step; a reward that did not apply: None); images stay PIL images until
    `write_rollouts` stores them."""
    rollout, rewards, advantages = experience.rollout, experience.rewards, experience.advantages
    lengths = rollout.lengths
    return [{"step": step, "group": first_group + i // group_size, "image": example.image,
             "images": list(example.images), "prompt": example.prompt,
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


def write_rollouts(run_dir: Path, step: int, rows: list[dict]) -> Path:
    """Write rollouts/step_XXXXXX.jsonl from `rollout_rows` of every process (images stored once)."""
    folder = Path(run_dir) / "rollouts"
    path = folder / f"step_{step:06d}.jsonl"
    with writing("rollouts", path):
        folder.mkdir(parents=True, exist_ok=True)
        lines = [{**row, "image": store_image(folder, row["image"]),
                  "images": [store_image(folder, image) for image in row["images"]],
                  **({"turns": [{**turn, "images": [store_image(folder, image) for image in turn["images"]]}
                                for turn in row["turns"]]} if "turns" in row else {})} for row in rows]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path
