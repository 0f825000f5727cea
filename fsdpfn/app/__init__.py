"""The application: the ``fsdpfn`` command (``cli``), the launcher that places and supervises
processes (``launcher``, ``supervise``) and the recipes that run from YAML (``recipes``).

Nothing below this package imports it (docs/architecture.md, tests/unit/test_layout.py).
"""
