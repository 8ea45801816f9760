"""The Video record's former home: it lives in vlmrl/data/video.py now (below both tasks/ and tools/,
which return it); this name stays for code that imports it from here. Its public name is
`vlmrl.tasks.Video`."""

from vlmrl.data.video import Video

__all__ = ["Video"]
