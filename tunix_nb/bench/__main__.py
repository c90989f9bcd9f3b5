"""`python -m tunix_nb.bench ...`: the command line, in `tunix_nb.bench.runner`."""

from tunix_nb.bench.runner import main

raise SystemExit(main())
