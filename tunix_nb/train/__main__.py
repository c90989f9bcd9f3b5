"""`python -m tunix_nb.train ...`: the command line, in `tunix_nb.cli`."""

from tunix_nb.cli import main

raise SystemExit(main())
