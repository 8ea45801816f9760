"""`vlmrl demo` (`make demo`): the pipeline end to end on the offline small model.

Builds the small Qwen2.5-VL-architecture model (random weights, offline), makes held-out
shape-counting examples, generates an answer for each and scores it with the task's reward.
An untrained model answers at random; this shows every piece runs on your machine, and where the
files go. Training on top of it comes with the trainer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from vlmrl.models import build_tiny_model, load_policy
from vlmrl.rollout import GenerationSettings, generate_groups
from vlmrl.tasks import get_task
from vlmrl.tiny_model import model_summary

DEMO_TASK = "shapes"


def ensure_tiny_model(folder: Path, size: str, seed: int = 0) -> Path:
    """Build the offline model into `folder` unless a matching one is already there."""
    info = folder / "vlmrl_tiny.json"
    if info.exists() and json.loads(info.read_text()).get("size") == size:
        return folder
    build_tiny_model(folder, size=size, seed=seed)
    return folder


def run_demo(out_dir: str = "runs/demo", n: int = 16, size: str = "small", batch_size: int = 8) -> dict:
    """Answer `n` test examples with the offline model; print and save the scores."""
    out = Path(out_dir)
    model_dir = ensure_tiny_model(out / "model", size)
    print(model_summary(model_dir))
    model, processor = load_policy(str(model_dir))
    model.eval()
    task = get_task(DEMO_TASK, seed=0)
    examples = [task.example(i, split="test") for i in range(n)]
    settings = GenerationSettings(group_size=1, max_new_tokens=32, greedy=True)
    rows = []
    for start in tqdm(range(0, n, batch_size), desc="generating", unit="batch"):
        batch = examples[start:start + batch_size]
        rollout = generate_groups(model, processor, batch, settings)
        for example, text in zip(batch, rollout.texts):
            rows.append({"prompt": example.prompt, "answer": example.answer, "completion": text,
                         "scores": task.score(example, text)})
    accuracy = sum(r["scores"]["accuracy"] for r in rows) / len(rows)
    mean_reward = sum(r["scores"]["total"] for r in rows) / len(rows)
    for r in rows[:4]:
        print(f"\nQ: {r['prompt']}\ngold: {r['answer']}  model: {r['completion'][:80]!r}  "
              f"reward {r['scores']['total']:.2f}")
    (out / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"task": DEMO_TASK, "examples": len(rows), "accuracy": accuracy, "mean_reward": mean_reward}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{DEMO_TASK}: accuracy {accuracy:.1%}, mean reward {mean_reward:.2f} over {len(rows)} "
          f"held-out examples (untrained model). Completions: {out / 'completions.jsonl'}")
    return summary
