"""vlmrl: teach vision-language models to reason about images with reinforcement learning.

GRPO and its variants (DAPO, Dr. GRPO, GSPO) on any Hugging Face image-text-to-text model, with
procedural visual reasoning tasks whose rewards resist hacking. See README.md and the `vlmrl` command.
"""

__version__ = "0.1.0"
