"""``python -m prefix_sharing``: the same as the ``prefix-sharing`` command."""

from .cli import main

raise SystemExit(main())
