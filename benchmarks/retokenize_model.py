"""Move a trained model onto another tokenizer of the same architecture (issue 53's probe).

    python benchmarks/retokenize_model.py TRAINED TOKENIZER_MODEL OUT

TRAINED is a model folder (a run's `final/`); TOKENIZER_MODEL a folder of the same architecture and
size with the tokenizer wanted (`vlmrl tiny-model OUT --size small --tokenizer letters`). OUT gets
TOKENIZER_MODEL's files with TRAINED's weights: every tensor is TRAINED's but the rows by token (the
token embedding, and the output layer where it is not tied), which take, for each token of the new
vocabulary whose text the old one has too, the old row, and keep their random row otherwise. This is
how the cryptogram's 2,560-word-step model was measured with the letter tokenizer without the
two hours of SFT before it (docs/results.md, "The cryptogram read from its letters").
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

BY_TOKEN = ("embed_tokens.weight", "lm_head.weight")
"""Endings of the parameter names whose rows are tokens."""


def vocabulary(folder: Path) -> dict[str, int]:
    """Token text -> id of a folder's tokenizer.json, added tokens included."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    return {**spec["model"]["vocab"], **{token["content"]: token["id"] for token in spec["added_tokens"]}}


def retokenize(trained: Path, target: Path, out: Path) -> tuple[int, int]:
    """Write OUT; return (rows taken from the trained embedding, rows of the new vocabulary)."""
    old_ids, new_ids = vocabulary(trained), vocabulary(target)
    old, new = load_file(trained / "model.safetensors"), load_file(target / "model.safetensors")
    if old.keys() != new.keys():
        raise SystemExit(f"{trained} and {target} are not the same architecture: their parameter names differ")
    shared = {text: (old_ids[text], new_id) for text, new_id in new_ids.items() if text in old_ids}
    merged = {}
    for name, fresh in new.items():
        trained_tensor = old[name]
        if not name.endswith(BY_TOKEN):
            if trained_tensor.shape != fresh.shape:
                raise SystemExit(f"{name}: {tuple(trained_tensor.shape)} -> {tuple(fresh.shape)}: not the same size")
            merged[name] = trained_tensor.clone()
            continue
        rows = fresh.clone()  # (new vocabulary, hidden)
        for old_id, new_id in shared.values():
            rows[new_id] = trained_tensor[old_id]
        merged[name] = rows
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(target, out)
    save_file(merged, out / "model.safetensors", metadata={"format": "pt"})
    return len(shared), len(new_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trained", type=Path, help="the trained model folder")
    parser.add_argument("target", type=Path, help="a folder of the same architecture with the tokenizer wanted")
    parser.add_argument("out", type=Path, help="where to write the moved model (replaced)")
    args = parser.parse_args()
    taken, total = retokenize(args.trained, args.target, args.out)
    print(f"wrote {args.out}: {taken} of {total} token rows from {args.trained}, the rest at their random start")


if __name__ == "__main__":
    main()
