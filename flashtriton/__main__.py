"""`python -m flashtriton`: the flashtriton command."""

from .cli import main

raise SystemExit(main())
