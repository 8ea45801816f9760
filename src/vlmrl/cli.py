"""The `vlmrl` command: parses arguments and calls one function per command; no logic of its own.

A `VlmrlError` (bad input: a missing folder, a config mistake) prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vlmrl.errors import VlmrlError


def _tiny_model(args: argparse.Namespace) -> None:
    from vlmrl.models import build_tiny_model
    from vlmrl.tiny_model import model_summary

    out = build_tiny_model(args.out, size=args.size, arch=args.arch, seed=args.seed)
    print(model_summary(out))


def _tasks_list(args: argparse.Namespace) -> None:
    from vlmrl.tasks.inspect import format_task_list

    print(format_task_list())


def _tasks_show(args: argparse.Namespace) -> None:
    from vlmrl.config import parse_override
    from vlmrl.tasks.inspect import show_task

    params = dict(parse_override(item) for item in args.params)
    print(show_task(args.name, params, split=args.split, n=args.n, out_dir=args.out))


def _config_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """`vlmrl config a=1` has no file: a first argument with `=` is an override, not a path."""
    if args.config is not None and "=" in args.config and not Path(args.config).exists():
        return None, [args.config, *args.overrides]
    return args.config, list(args.overrides)


def _config(args: argparse.Namespace) -> None:
    from vlmrl.config import describe, load_config, save_config

    config = load_config(*_config_and_overrides(args))
    if args.docs:
        print("\n".join(describe(config)))
    else:
        import yaml

        from vlmrl.config import to_dict

        print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
    if args.save:
        save_config(config, args.save)


def _train(args: argparse.Namespace) -> None:
    from vlmrl.config import load_config
    from vlmrl.trainer import train

    run_dir = train(load_config(*_config_and_overrides(args)))
    print(f"done: {run_dir} (final model in {run_dir / 'final'}, metrics in {run_dir / 'metrics.jsonl'})")


def _demo(args: argparse.Namespace) -> None:
    from vlmrl.demo import run_demo

    run_demo(out_dir=args.out, n=args.n, size=args.size)


def build_parser() -> argparse.ArgumentParser:
    from vlmrl.tiny_model import ARCHES, SIZES

    parser = argparse.ArgumentParser(
        prog="vlmrl",
        description="Teach vision-language models to reason about images with GRPO and its variants.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tiny = commands.add_parser(
        "tiny-model", help="build an offline random-weight VLM of a real architecture",
        description="Build a VLM of a real architecture with random weights, a tokenizer trained "
                    "offline and an image processor that needs no torchvision; saved with "
                    "save_pretrained so it loads like any hub model.")
    tiny.add_argument("out", help="folder to write the model into")
    tiny.add_argument("--size", choices=SIZES, default="tiny",
                      help="tiny: ~0.2M parameters, for tests; small: ~4M, learns the built-in tasks")
    tiny.add_argument("--arch", choices=ARCHES, default="qwen2_5_vl", help="architecture family")
    tiny.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    tiny.set_defaults(func=_tiny_model)

    tasks = commands.add_parser("tasks", help="list the built-in tasks or look at examples",
                                description="List the tasks, or write example images and print "
                                            "prompts, answers and reference-completion scores.")
    task_commands = tasks.add_subparsers(dest="tasks_command", required=True, metavar="ACTION")
    task_commands.add_parser("list", help="the registered tasks and their parameters").set_defaults(
        func=_tasks_list)
    show = task_commands.add_parser("show", help="print examples of a task and save their images")
    show.add_argument("name", help="task name (see `vlmrl tasks list`)")
    show.add_argument("--split", default="train", help="train, test or ood (default train)")
    show.add_argument("--n", type=int, default=4, help="how many examples (default 4)")
    show.add_argument("--out", default=None, help="folder for the example images (PNG)")
    show.add_argument("params", nargs="*", metavar="KEY=VALUE", help="task parameters, e.g. max_words=2")
    show.set_defaults(func=_tasks_show)

    train = commands.add_parser(
        "train", help="train a policy with GRPO / DAPO / Dr. GRPO / GSPO",
        description="Train with reinforcement learning from the task's verifiable rewards. Several "
                    "processes: `accelerate launch -m vlmrl train CONFIG ...`.",
        epilog="examples:\n  vlmrl train configs/shapes_grpo_tiny.yaml train.steps=50\n"
               "  vlmrl train configs/shapes_grpo_tiny.yaml output_dir=runs/a resume=true\n"
               "every key and its meaning: vlmrl config --docs",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("config", nargs="?", default=None, help="YAML config (see configs/)")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="dotted overrides, e.g. train.lr=1e-6 algorithm.beta=0")
    train.set_defaults(func=_train)

    config = commands.add_parser("config", help="print a run config after overrides, with docs",
                                 description="Load a YAML config, apply key=value overrides, check "
                                             "every key and type, and print the result.")
    config.add_argument("config", nargs="?", default=None, help="YAML file (default: all defaults)")
    config.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, e.g. model.dtype=bfloat16")
    config.add_argument("--docs", action="store_true", help="print every field with its docstring")
    config.add_argument("--save", default=None, metavar="FILE", help="also write the result as YAML")
    config.set_defaults(func=_config)

    demo = commands.add_parser("demo", help="the embedded demo on the offline small model",
                               description="Build the offline small model, make shape-counting "
                                           "examples, generate answers and score them.")
    demo.add_argument("--out", default="runs/demo", help="run directory (default runs/demo)")
    demo.add_argument("--n", type=int, default=16, help="held-out examples to answer (default 16)")
    demo.add_argument("--size", choices=SIZES, default="small", help="model size (default small)")
    demo.set_defaults(func=_demo)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Like parse_args, but KEY=VALUE items may also come after options (`show NAME --n 1 a=2`)."""
    args, extra = parser.parse_known_args(argv)
    for name in ("params", "overrides"):
        if hasattr(args, name) and extra and all("=" in item and not item.startswith("-") for item in extra):
            getattr(args, name).extend(extra)
            return args
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(build_parser(), argv)
    try:
        args.func(args)
    except VlmrlError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
