"""`python -m retool_trl`: the `retool-trl` command line."""

from .cli import main

raise SystemExit(main())
