"""The rollout viewer's data: logged steps, their groups, completions ranked best to worst.

The page embeds at most MAX_STEPS logged steps (evenly spaced; the first and last always among
them) and at most MAX_GROUPS groups of each, so a long run's report stays small. Each
distinct image is embedded once, as a data URI no larger than MAX_IMAGE_SIDE pixels a side. Each
group names the data row (and its id) or the generated example its prompt comes from (`source_of`).
"""

from __future__ import annotations

import base64
import io
import math
from pathlib import Path

from PIL import Image

from vlmrl.report.rundir import RunDir, read_rollout_rows

MAX_STEPS = 24
"""Most logged rollout steps embedded in a report."""
MAX_GROUPS = 16
"""Most groups (prompts) embedded per step."""
MAX_IMAGE_SIDE = 384
"""Images with a longer side are shrunk to it (aspect kept) before embedding."""
MAX_TURNS = 12
"""Turns of a multi-turn completion shown in the viewer (the log keeps them all)."""
MAX_TURN_IMAGES = 2
"""Images of one turn shown in the viewer."""


def pick_steps(steps: list[int], most: int = MAX_STEPS) -> list[int]:
    """At most `most` of the ascending `steps`, evenly spread, always keeping the first and last."""
    if len(steps) <= most:
        return list(steps)
    if most == 1:
        return [steps[-1]]
    return [steps[round(i * (len(steps) - 1) / (most - 1))] for i in range(most)]


def rollout_data(run: RunDir) -> dict:
    """JSON-ready viewer data: {"steps": [...], "images": {key: data URI}, counts for the caption}."""
    images: dict[str, str | None] = {}
    steps = []
    for step in pick_steps(list(run.rollout_files)):
        groups = group_rows(read_rollout_rows(run.rollout_files[step], run))
        steps.append({"step": step, "groups_total": len(groups),
                      "groups": [_group(rows, run, images) for rows in groups[:MAX_GROUPS]]})
    return {"steps": steps, "steps_total": len(run.rollout_files), "max_groups": MAX_GROUPS,
            "images": {key: uri for key, uri in images.items() if uri is not None}}


def group_rows(rows: list[dict]) -> list[list[dict]]:
    """Rows split into groups: by their "group" index, or else runs of the same image and prompt."""
    if rows and all("group" in row for row in rows):
        by_index: dict = {}
        for row in rows:
            by_index.setdefault(str(row["group"]), []).append(row)
        return list(by_index.values())
    groups: list[list[dict]] = []
    for row in rows:
        key = (row.get("image"), row.get("prompt"), row.get("answer"))
        if groups and (groups[-1][0].get("image"), groups[-1][0].get("prompt"), groups[-1][0].get("answer")) == key:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def total_of(row: dict) -> float:
    """A completion's total reward (-inf when it has none, so it ranks last)."""
    value = _number((row.get("rewards") or {}).get("total"))
    return -math.inf if value is None else value


def _group(rows: list[dict], run: RunDir, images: dict[str, str | None]) -> dict:
    """One prompt and its completions, best first; best and worst marked when the rewards differ."""
    ranked = sorted(rows, key=total_of, reverse=True)
    totals = [total_of(r) for r in ranked if total_of(r) > -math.inf]
    signal = len(totals) > 1 and max(totals) > min(totals)
    first = rows[0]
    image = first.get("image")
    key = str(image) if image else None
    names = [str(name) for name in first.get("images") or ([image] if image else [])]
    for name in names:
        if name not in images:
            images[name] = image_data_uri(run.path / "rollouts", name)
    completions = []
    for index, row in enumerate(ranked):
        mark = ("best" if index == 0 else "worst" if index == len(ranked) - 1 else "") if signal else ""
        rewards = row.get("rewards") if isinstance(row.get("rewards"), dict) else {}
        completions.append({
            "text": _text(row.get("completion")),
            "rewards": {str(k): _number(v) for k, v in rewards.items()},
            "advantage": _number(row.get("advantage")),
            "length": _number(row.get("length")),
            "truncated": bool(row.get("truncated", False)),
            "mark": mark,
            **_turns(row, run, images),
        })
    return {"image": key if key and images.get(key) else None, "image_name": key, "image_names": names,
            "source": source_of(first), "prompt": _text(first.get("prompt")), "answer": _text(first.get("answer")),
            "mean": sum(totals) / len(totals) if totals else None, "signal": signal,
            "completions": completions}


def source_of(row: dict) -> str:
    """Where a logged prompt comes from, in words: "row 12 of train · id q-0012" for a data file's row,
    "example 7 of train" for a generated one; "" for a log written before rows were traced."""
    parts = []
    if row.get("row") is not None:
        parts.append(f"row {_text(row['row'])} of {_text(row.get('source_split') or row.get('split'))}")
    elif row.get("idx") is not None:
        parts.append(f"example {_text(row['idx'])} of {_text(row.get('split'))}")
    if row.get("id") is not None:
        parts.append(f"id {_text(row['id'])}")
    return " · ".join(parts)


def _turns(row: dict, run: RunDir, images: dict[str, str | None]) -> dict:
    """{"turns": [...]} of a multi-turn completion (role, text, its images' keys), images embedded once."""
    turns = row.get("turns")
    if not isinstance(turns, list):
        return {}
    shown = []
    for turn in turns[:MAX_TURNS]:
        names = [str(name) for name in (turn.get("images") or [])][:MAX_TURN_IMAGES]
        for name in names:
            if name not in images:
                images[name] = image_data_uri(run.path / "rollouts", name)
        shown.append({"role": _text(turn.get("role")), "text": _text(turn.get("text")), "images": names})
    return {"turns": shown}


def image_data_uri(folder: Path, relative: str) -> str | None:
    """`folder/relative` as a PNG or JPEG data URI, shrunk to MAX_IMAGE_SIDE (an animated GIF, a
    video of the rollout log, as it is where it fits, else its first frame); None if unreadable or
    outside the run directory."""
    path = (folder / relative).resolve()
    if not path.is_relative_to(folder.parent.resolve()) or not path.is_file():
        return None
    try:
        with Image.open(path) as image:
            kind = image.format if image.format in ("JPEG", "GIF") else "PNG"
            if image.format == kind and max(image.size) <= MAX_IMAGE_SIDE:
                data = path.read_bytes()
            else:
                kind = "PNG" if kind == "GIF" else kind
                image.thumbnail((MAX_IMAGE_SIDE, MAX_IMAGE_SIDE))
                buffer = io.BytesIO()
                mode = "RGB" if kind == "JPEG" else image.mode if image.mode in ("RGB", "RGBA", "L", "P") else "RGBA"
                image.convert(mode).save(buffer, format=kind)
                data = buffer.getvalue()
    except (OSError, ValueError):
        return None
    return f"data:image/{kind.lower()};base64,{base64.b64encode(data).decode('ascii')}"


def _text(value) -> str:
    return "" if value is None else value if isinstance(value, str) else str(value)


def _number(value) -> float | None:
    """A finite float, or None (JSON has no NaN)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None
