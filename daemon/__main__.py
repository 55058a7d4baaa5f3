"""``python -m statetier.daemon`` — the ``statetier`` command line (``daemon/cli/``)."""

from statetier.daemon.cli import main

raise SystemExit(main())
