"""``python -m resilient``: the same as the ``resilient`` command."""

from resilient.cli import main

raise SystemExit(main())
