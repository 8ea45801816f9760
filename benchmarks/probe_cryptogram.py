"""What the offline model's vision tower can read of a cryptogram decoder: a linear probe.

For each decoder image, the tower's merged-patch features (what the language model receives) at
the plain-letter cells are labelled with the letter drawn there; a ridge classifier (one-vs-rest,
closed form) fitted on the train split's images is scored on the test split's. Chance is
1 / len(letters). Run with the task parameters to try:

    python benchmarks/probe_cryptogram.py runs/small-model layout=grid cell_px=28 letters=etaoinshr

A cell of cell_px > 28 covers several merged patches: their features are averaged.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from vlmrl.models import load_policy
from vlmrl.tasks import get_task


@torch.no_grad()
def cell_features(model, processor, example) -> tuple[np.ndarray, list[str]]:
    """(n_cells, D) mean merged-patch feature of each plain-letter cell, and the letters drawn."""
    inputs = processor.image_processor(images=[example.image], return_tensors="pt")
    t, h, w = (int(v) for v in inputs["image_grid_thw"][0])
    merge = processor.image_processor.merge_size
    rows, cols = h // merge, w // merge
    out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    feats = out.pooler_output[0].reshape(rows, cols, -1)  # (rows, cols, D)
    scale_y, scale_x = rows / example.image.height, cols / example.image.width  # tokens per pixel
    cipher, letters = example.meta["cipher"], example.meta["letters"]
    decode = {coded: plain for plain, coded in zip(letters, cipher)}
    vectors, labels = [], []
    for coded, (x0, y0, x1, y1) in example.meta["cells"].items():
        r0, r1 = int(y0 * scale_y), max(int(y0 * scale_y) + 1, round(y1 * scale_y))
        c0, c1 = int(x0 * scale_x), max(int(x0 * scale_x) + 1, round(x1 * scale_x))
        vectors.append(feats[r0:r1, c0:c1].reshape(-1, feats.shape[-1]).mean(0).numpy())
        labels.append(decode[coded])
    return np.stack(vectors), labels


def ridge_accuracy(train_x, train_y, test_x, test_y, alpha: float = 1.0) -> float:
    """Accuracy of a one-vs-rest ridge classifier on standardised features."""
    classes = sorted(set(train_y) | set(test_y))
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    a, b = (train_x - mean) / std, (test_x - mean) / std
    targets = np.array([[1.0 if y == c else -1.0 for c in classes] for y in train_y])  # (N, C)
    a1, b1 = np.hstack([a, np.ones((len(a), 1))]), np.hstack([b, np.ones((len(b), 1))])
    weights = np.linalg.solve(a1.T @ a1 + alpha * np.eye(a1.shape[1]), a1.T @ targets)  # (D+1, C)
    predicted = [classes[i] for i in (b1 @ weights).argmax(1)]
    return float(np.mean([p == y for p, y in zip(predicted, test_y)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("params", nargs="*", help="task parameters, key=value")
    parser.add_argument("--images", type=int, default=150, help="decoder images per split")
    args = parser.parse_args()
    params = dict(item.split("=", 1) for item in args.params)
    task = get_task("cryptogram", seed=0, **params)
    model, processor = load_policy(args.model, device="cpu")
    model.eval()
    data = {}
    for split in ("train", "test"):
        xs, ys = zip(*(cell_features(model, processor, task.example(i, split)) for i in range(args.images)))
        data[split] = (np.concatenate(xs), [y for labels in ys for y in labels])
    accuracy = ridge_accuracy(*data["train"], *data["test"])
    letters = task.params.letters
    print(f"{' '.join(args.params)}: {accuracy:.1%} of {len(data['test'][1])} held-out cells "
          f"(chance {1 / len(letters):.1%}, features {data['train'][0].shape[1]})")


if __name__ == "__main__":
    main()
