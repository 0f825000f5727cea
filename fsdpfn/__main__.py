"""``python -m fsdpfn ...`` is the ``fsdpfn`` command (see fsdpfn/app/cli.py)."""

from fsdpfn.app.cli import main

raise SystemExit(main())
