"""The preflight's memory estimate for a config at the full Qwen2.5-VL-3B size: now
`estimate_real.py --arch qwen2_5_vl_3b` (one script for every real architecture); this name is kept
for the commands in RESULTS.md.

Run: `python benchmarks/estimate_3b.py [--config configs/shapes_grpo_3b.yaml --prompt 1100
--completion 256 --image-tokens 1024] [KEY=VALUE ...]`; prints the per-layer costs and the estimate
with checkpointing off, on and auto (add `train.pack_groups=false` for plain rows).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from estimate_real import main  # noqa: E402

if __name__ == "__main__":
    args = sys.argv[1:]
    main(["--arch", "qwen2_5_vl_3b", *(["--prompt", "1100"] if "--prompt" not in args else []),
          *(["--image-tokens", "1024"] if "--image-tokens" not in args else []), *args])
