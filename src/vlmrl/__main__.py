"""`python -m vlmrl` (and `accelerate launch -m vlmrl ...`) is the `vlmrl` command."""

import sys

from vlmrl.cli import main

sys.exit(main())
