"""The verifiable tasks: procedural or dataset-backed examples with hack-resistant rewards.

    from vlmrl.tasks import get_task
    task = get_task("cryptogram", seed=0, max_words=3)
    example = task.example(7, split="train")
    task.score(example, completion)  # {"total": ..., "accuracy": ..., components by name}

Built in: census, cryptogram, shapes, geometry, grounding, zoom, motion (video), and `dataset` for your own data (docs/data.md). Pure Python (PIL), no torch.
"""

from vlmrl.tasks import census, cryptogram, dataset, geometry, grounding, motion, shapes, zoom  # noqa: F401  (registers the tasks)
from vlmrl.tasks.base import Example, Task, TaskParams, Video, get_task, list_tasks, register_task, run_task

__all__ = ["Example", "Task", "TaskParams", "Video", "get_task", "list_tasks", "register_task", "run_task"]
