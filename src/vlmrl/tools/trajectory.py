"""The trajectory record: the turns of a tool-using rollout after the prompt, the model's and the tools'.

The rollout builds it (rollout/tool_rollout.py), tasks score it and write reference trajectories in it
(`Task.score_trajectory`, the zoom task's), the report reads it. No torch here: tasks import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from PIL import Image

from vlmrl.tools.calls import ToolCall


@dataclass
class Turn:
    """One turn of a trajectory after the prompt: the model's text, or a tool's result."""

    role: str  # "assistant" or "tool"
    text: str
    images: list[Image.Image] = field(default_factory=list)
    """Tool turns: the images shown, a returned video's frames included (for the logs and the report)."""
    call: ToolCall | None = None  # assistant turns that end in a call: the parsed call
    error: str | None = None  # tool turns: ToolResult.error


@dataclass
class Trajectory:
    """Everything after the prompt: the model's turns and the tools' results, in order."""

    turns: list[Turn] = field(default_factory=list)
    cut: bool = False
    """True when the turn limit or the token budget ended it before a final answer."""

    @property
    def final_text(self) -> str:
        """The model's last turn (where the final answer is)."""
        return next((t.text for t in reversed(self.turns) if t.role == "assistant"), "")

    @property
    def calls(self) -> list[ToolCall]:
        """Every parsed call, in order."""
        return [t.call for t in self.turns if t.call is not None]

    @property
    def errors(self) -> list[str]:
        """The error kind of every failed call, in order."""
        return [t.error for t in self.turns if t.role == "tool" and t.error is not None]
