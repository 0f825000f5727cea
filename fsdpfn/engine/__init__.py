"""The engine: mesh, sharded state, the packed forward, the one backward and optimizer step.

Every public name here is re-exported by ``fsdpfn`` (``import fsdpfn as ff``); the modules are
imported on first use. docs/architecture.md names each module's one job.
"""
