"""``python -m fsdpfn ...`` is the ``fsdpfn`` command (see fsdpfn/cli.py)."""

from fsdpfn.cli import main

raise SystemExit(main())
