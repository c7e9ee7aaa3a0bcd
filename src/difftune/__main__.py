"""`python -m difftune ...`: the same command line as `difftune ...` (torchrun and accelerate launch take either
`-m difftune` or `-m difftune.cli`)."""

import sys

from difftune.cli import main

sys.exit(main())
