"""The cryptogram demo's attention measure on the walk's letters, where a "pairs" model looks letters up.

With `reference=pairs` the reference writes each coded letter followed by its plain letter before
the <chars> block ("a t, o h, ..."), and copies the <chars> letters from that walk. The demo's table
measures the walk's letters (`Task.answer_regions` of a pairs task); this measures them the same way
(`cryptogram.walk_letter_cells`, `region_attention`) for any model folders given, checkpoints too:

    python benchmarks/cryptogram_walk_attention.py runs/demo-cryptogram/sft/config.yaml \\
        runs/demo-cryptogram/model runs/demo-cryptogram/sft/final runs/demo-cryptogram/grpo/final
"""

from __future__ import annotations

import argparse

from vlmrl.config import load_config
from vlmrl.evaluation.cell_attention import region_attention
from vlmrl.evaluation.evaluate import held_out_examples
from vlmrl.models import load_policy
from vlmrl.tasks import get_task
from vlmrl.tasks.cryptogram import walk_letter_cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a run's config.yaml (its task and parameters)")
    parser.add_argument("models", nargs="+", help="model folders")
    parser.add_argument("--n", type=int, default=64, help="held-out test examples (default 64)")
    args = parser.parse_args()
    config = load_config(args.config, [])
    task = get_task(config.task.name, seed=config.seed, **config.task.params)
    examples = held_out_examples(task, "test", args.n)
    for folder in args.models:
        model, processor = load_policy(folder, device="cpu")
        result = region_attention(model, processor, examples, [walk_letter_cells(e) for e in examples]).summary()
        layers = ", ".join(f"{share:.1%}" for share in result["per_layer"])
        print(f"{folder}: mean {result['share']:.1%} ({result['ratio']:.1f}x uniform {result['uniform']:.1%}), "
              f"per layer {layers}; best layer {result['best_layer']} {result['best_ratio']:.1f}x; "
              f"{result['spans']} letters")


if __name__ == "__main__":
    main()
