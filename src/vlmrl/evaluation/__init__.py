"""Evaluation: does the model solve held-out examples, and does it look at the image?

    evaluate.py         accuracy, pass@k, OOD splits and the blind-image check (`vlmrl eval`)
    eval_settings.py    what an evaluation runs, as one object
    attention.py        the share of attention completion tokens put on image tokens
    attention_maps.py   `vlmrl attention`: per-token heatmaps over the image

May import: rollout, models, report, tasks, config, seeds, errors. Nothing from training or
safety.
"""
