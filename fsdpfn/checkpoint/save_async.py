"""AsyncSave: a checkpoint whose files are written while training goes on.

save_checkpoint(..., async_save=True) hands its state dict here: a host copy is staged and agreed
on in the calling thread, then a background thread writes it with DCP over a gloo process group of
its own and hands the outcome to the caller's publication. This module owns those threads and
groups: a group is retired when its save is waited on and destroyed at a later save
(``start_save``) once every rank has retired it. ``wait_for_prior`` orders two saves
(``publish_after``).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fsdpfn.agree import agree_on_error_in_group, rank, world_size
from fsdpfn.checkpoint.dcp import DCP_ERRORS, as_checkpoint_error
from fsdpfn.checkpoint.files import discard
from fsdpfn.errors import CheckpointError


class AsyncSave:
    """Handle of ``save_checkpoint(..., async_save=True)``.

    The state was copied to CPU memory before save_checkpoint returned, so training may go on
    (the next steps mutate the parameters in place). The write and the publication run in a
    background thread, over a process group of their own. Call ``wait()`` on every rank before
    the next save to the same path and before the job ends: it returns once the checkpoint is
    published, or raises CheckpointError on every rank (nothing is published then).
    """

    def __init__(self, path: Path, group):
        self.path = path
        #: time.perf_counter() when the background save ended (published or failed), else None
        self.finished_at: float | None = None
        self._group = group
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _start(self, body) -> None:
        def run():
            try:
                body()
            except BaseException as exc:  # noqa: BLE001 - handed to wait()
                self._error = exc if isinstance(exc, CheckpointError) else as_checkpoint_error(
                    "save_checkpoint", f"asynchronous save to {str(self.path)!r}", exc)
            finally:
                self.finished_at = time.perf_counter()

        self._thread = threading.Thread(target=run, name="fsdpfn-async-save", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        """True once the background save finished (successfully or not)."""
        return self._thread is not None and not self._thread.is_alive()

    @property
    def published(self) -> bool:
        """True once the checkpoint is published; False while the save runs or after it failed
        (``wait()`` raises that failure). Every rank agrees on the outcome, so a rank reading
        True knows the checkpoint is in place."""
        return self.done() and self._error is None

    def _join_after(self) -> BaseException | None:
        """In the background thread of a save that must publish after this one: wait for this
        one's outcome; its failure, or None once it is published."""
        self._thread.join()
        return self._error

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is published; raise CheckpointError if the save failed."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"save_checkpoint: asynchronous save to {str(self.path)!r} still "
                               f"running after {timeout} s")
        if self._group is not None:
            _retire(self._group)
            self._group = None
        if self._error is not None:
            raise self._error


# The process groups of finished asynchronous saves, by name. A group is destroyed only once
# every rank has finished with it: a rank that closed its connections while another still read
# the last message of the save's final agreement would leave that one waiting for gloo's timeout.
_RETIRED: dict[str, Any] = {}


def _retire(group) -> None:
    """This rank's background save over ``group`` is over: destroy it at the next save that
    finds it retired on every rank."""
    _RETIRED[group.group_name] = group


def _registered(group) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def start_save(value):
    """Rank 0's ``value`` on every rank, and the groups every rank has retired destroyed
    (one collective; every save, synchronous or not, starts with it)."""
    for name, group in list(_RETIRED.items()):
        if not _registered(group):  # gone with a default group destroyed since
            del _RETIRED[name]
    if world_size() == 1:
        return value
    mine = sorted(_RETIRED)
    every: list = [None] * world_size()
    dist.all_gather_object(every, (value, mine))
    done = set(mine).intersection(*(set(names) for _, names in every))
    for name in sorted(done):
        dist.destroy_process_group(_RETIRED.pop(name))
    return every[0][0]


def wait_for_prior(publish_after: AsyncSave | None, target: Path) -> CheckpointError | None:
    """Wait for the save this one publishes after; the reason not to publish, or None."""
    failed = publish_after._join_after() if publish_after is not None else None
    if failed is None:
        return None
    return CheckpointError(f"save_checkpoint: {str(target)!r} not published: the save it "
                           f"publishes after ({str(publish_after.path)!r}) failed: {failed}")


def _test_delay(target: Path) -> None:
    """FSDPFN_TEST_SAVE_DELAY=<name>=<seconds> (tests only): an asynchronous save to a path
    named <name> sleeps that long between writing its files and publishing them, as on a slow
    file system, so that a test can kill a run while that save is in flight."""
    name, _, seconds = os.environ.get("FSDPFN_TEST_SAVE_DELAY", "").partition("=")
    if name and name == target.name:
        time.sleep(float(seconds))


def _stage(state_dict):
    """A host copy of ``state_dict`` (DTensors keep their layout), taken in the calling thread:
    what the background write reads while training mutates the live tensors. Returns the copy
    and the stager that owns its memory (closed once the write ends).

    DTensors over a view at an offset (the per-layer step's moments live in reserved blocks of
    host memory) report a storage of their own, which torch's stager cannot copy ("invalid
    python storage"): those are copied here, one contiguous host copy each, and the rest by the
    stager."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    own: dict[tuple, torch.Tensor] = {}
    rest = _set_aside(state_dict, own)
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=False))
    try:
        staged = stager.stage(rest)
        for path, value in own.items():
            node = staged
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = _host_copy(value)
        return staged, stager
    except BaseException:
        stager.close()
        raise


def _set_aside(node, own: dict, path: tuple = ()):
    """``node`` (a tree of dicts) with every DTensor whose wrapper reports a storage replaced by
    None, each recorded in ``own`` under its path."""
    if isinstance(node, dict):
        return {k: _set_aside(v, own, path + (k,)) for k, v in node.items()}
    if isinstance(node, torch.Tensor) and hasattr(node, "_local_tensor") and node.data_ptr():
        own[path] = node
        return None
    return node


def _host_copy(value: torch.Tensor) -> torch.Tensor:
    """A DTensor of the same layout over a contiguous host copy of ``value``'s local part."""
    from torch.distributed.tensor import DTensor

    local = value._local_tensor.detach()  # noqa: SLF001
    copy = torch.empty(local.shape, dtype=local.dtype, device="cpu").copy_(local)
    return DTensor(copy, value._spec, requires_grad=False)  # noqa: SLF001


def save_async(state_dict, tmp: Path, target: Path, publish_after: AsyncSave | None,
               publish: Callable[[Callable, BaseException | None], None]) -> AsyncSave:
    """Stage a host copy of ``state_dict`` (collective, in the calling thread), then write it
    to ``tmp`` in a background thread over a new process group and call ``publish(agree_fn,
    error)`` there: ``agree_fn`` agrees on an error over that group, ``error`` is the write's
    failure or the reason not to publish (``publish_after`` failed), else None. The handle's
    ``wait()`` returns once ``publish`` did, or raises its failure."""
    # Two threads, two groups, never crossed: the calling thread (training's) uses the default
    # group only, the background thread only a group of its own. The copy is taken and agreed on
    # in the calling thread before the background thread issues its first collective: a write
    # started at once (as dcp.async_save does) would race the agreement on its group, and ranks
    # that ordered the two differently would wait for each other for ever.
    staged, stager, staging_error = None, None, None
    try:
        staged, stager = _stage(state_dict)
    except DCP_ERRORS as exc:
        staging_error = as_checkpoint_error("save_checkpoint", f"staging {str(tmp)!r}", exc)
    try:
        agree_on_error_in_group(None, staging_error, error_type=CheckpointError)
    except BaseException:
        if stager is not None:
            stager.close()
        if rank() == 0:
            discard(tmp)
        raise
    group = dist.new_group(backend="gloo") if world_size() > 1 else None
    handle = AsyncSave(target, group)

    def body():
        error = None
        try:
            dcp.save(staged, checkpoint_id=tmp, process_group=group)
        except DCP_ERRORS as exc:
            error = as_checkpoint_error("save_checkpoint", f"writing {str(tmp)!r}", exc)
        finally:
            stager.close()
        error = error or wait_for_prior(publish_after, target)
        _test_delay(target)
        publish(lambda e: agree_on_error_in_group(group, e, error_type=CheckpointError), error)

    handle._start(body)  # noqa: SLF001
    return handle
