"""`python -m moejax ...` is the `moejax` command (moejax.entry), host-memory set-up included."""

import sys

from moejax.entry import main

sys.exit(main())
