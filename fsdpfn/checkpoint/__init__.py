"""save_checkpoint, load_checkpoint, export_hf: checkpoints that never lose a run.

A checkpoint is a directory written with torch.distributed.checkpoint (DCP): every rank writes its
own shards, and any mesh shape can load it (dp=2 -> dp=1, dp=1 -> dp=2 x tp=2, ...)::

    <path>/
      .metadata            DCP metadata: every key's global shape, dtype and chunks
      __<r>_<i>.distcp     DCP data: model and optimizer shards, written by rank r
      rng/rank_<r>.pt      rank r's RNG state (torch CPU, CUDA, python random, numpy)
      fsdpfn.json          manifest: step, version, architecture, optimizer status, LR scheduler
                           state, ``extra``, the size of every file above, ``checksums``: every
                           saved chunk's content checksum and a CRC32 of the pickled items,
                           .metadata and the RNG files (fsdpfn.checkpoint.integrity), and
                           ``manifest_crc32``: the CRC32 of the rest of the manifest (canonical
                           JSON), checked before anything in it is trusted
      COMPLETE             the marker, written last; a directory without it is not a checkpoint

DCP keys are ``model.<fqn>`` (fqn as in ``state.model.state_dict()``, prefix ``lm.``) and torch's
flattened optimizer state dict under ``optim.``: ``optim.state.<fqn>.<exp_avg|exp_avg_sq|step>``
and ``optim.param_groups.<fqn>.<hyper-parameter>``. Tensors are the fp32 master weights and fp32
Adam moments (``optimizer_dtype``), saved as sharded DTensors.

Atomic publication: every rank writes into ``<path>.tmp-<token>`` next to the target (rank 0 puts an
OWNER file there naming its host and pid, removed once published); rank 0 then records the file
sizes in the manifest, writes COMPLETE, fsyncs and renames the directory to ``<path>``. An existing
checkpoint at ``<path>`` is first renamed aside to ``<path>.old-<token>`` and deleted after the new
one is in place. A crash at any point leaves either the previous checkpoint or the new one complete,
and no directory that carries COMPLETE without all of its data; ``load_checkpoint`` of a ``<path>``
whose publication was interrupted between the two renames reads the complete sibling. The next save
into the same directory finishes such a publication (the complete ``*.tmp-*`` of a dead save, else
the ``*.old-*`` copy, takes the missing ``<path>``) and removes the other leftovers (``*.old-*``,
``*.tmp-*`` of processes that died), as ``fsdpfn run --resume`` does before it reads the latest
checkpoint (``checkpoint.files.clean_up_leftovers``). ``keep_last`` never deletes a checkpoint
saved after the one being published. One run per directory: rotation and ``latest_checkpoint``
count every fsdpfn checkpoint beside ``path``. Saves to the same path must not overlap
(``wait()`` an asynchronous save before starting the next one to that path). Every rank must see
the same file system (one host, or a shared file system).

Decisions (documented contract):

* ``load_checkpoint`` returns the successor with the saved ``step`` and
  ``version = max(state.version, saved version) + 1`` (weights changed, and versions never go
  back, so a rollout engine never mistakes the loaded weights for ones it holds).
* The optimizer's moments and step counts and the LR schedule's position are the checkpoint's;
  the hyper-parameters (lr, betas, eps, weight decay, schedule, warm-up) are the loading state's
  OptimizerConfig: a state built with a changed config continues with it from the saved step
  (``--resume`` with a new ``optimizer.lr``), and ``state.config`` says what runs.
* A trainable state loading a checkpoint without optimizer state (saved from an inference-only
  state), and an inference-only state loading one with optimizer state, raise CheckpointError;
  ``weights_only=True`` loads just the model weights (the state keeps its own optimizer, LR
  scheduler, step and RNG). A trainable state that never stepped has no Adam moments yet; its
  checkpoint records that (optimizer status ``empty``) and loading it leaves the optimizer without
  moments, exactly as saved.
* RNG: at the saved world size, rank r gets rank r's RNG state back; at another world size rank r
  gets saved rank (r mod saved world size)'s.
* ``extra`` must be JSON that round-trips unchanged (dict with str keys; lists, not tuples); rank
  0's is stored and every rank gets it back (``{}`` when none was saved).
* Everything the load reads is checked before anything changes: the marker, the manifest, every
  file's size, every byte of data against the checksums recorded at save (a chunk that differs,
  or that torch's loader cannot read, raises CheckpointError naming the file and the tensor; at
  any world size: each rank sums the parts of saved chunks it reads, on the device, and the
  parts are added over the ranks), the architecture (model_type, sizes, heads, vocabulary, tied
  embeddings, critic; the config fields that change the forward for the same weights, such as
  rope_theta or a window, are compared too, and a difference is a UserWarning naming them, not
  a refusal: continued training under a longer rotary base loads on purpose), and every key's
  shape and dtype against the DCP metadata (DCP itself
  would silently cast dtypes and ignore extra keys). The data are read into fresh buffers and
  applied only after every rank read them, so a failure at any stage leaves the state unchanged
  and live, on every rank.
* ``async_save=True`` stages a CPU copy of the state before returning (DCP's stager), then writes
  and publishes in a background thread over a gloo group of its own; the returned AsyncSave's
  ``wait()`` (on every rank) returns once published or raises CheckpointError everywhere.
  ``publish_after=handle`` orders two checkpoints (a critic's before its policy's): the second
  publishes only once the first did. A crash while a save is in flight leaves its
  ``<path>.tmp-<token>`` unpublished and the previous checkpoints intact. Tests only: the
  environment variable ``FSDPFN_TEST_SAVE_DELAY=<name>=<seconds>`` makes an asynchronous save
  to a path named ``<name>`` wait that long between writing and publishing (a slow file
  system), so a test can kill a run mid-save.
* ``export_hf`` writes ``config.dtype`` (the compute dtype) by default; ``dtype="float32"`` gives
  the fp32 master weights exactly.
* LoRA states (``config.lora``): the checkpoint holds the adapters alone (``model.`` keys of the
  adapter matrices) and their optimizer state; the frozen base is rebuilt from
  ``config.model_path`` by shard_model. ``export_hf`` writes peft's adapter directory, or with
  ``merged=True`` the HF model with the adapters folded in.

Resuming: ``latest_intact_checkpoint(root)`` is the newest complete checkpoint whose every byte
checks out (``check_checkpoint``, from the files alone); a corrupted newer one is skipped with a
warning naming it and why. The recipes resume from it.

The package, by stage: ``files`` (layout, file-system helpers, atomic publication,
``latest_checkpoint``; the standard library only), ``dcp`` (DCP's options and errors, the
collective helpers), ``save`` (manifest, RNG, ``save_checkpoint`` and its publication),
``save_async`` (``AsyncSave``: the background write of an asynchronous save and the process
groups it owns), ``load`` (``load_checkpoint``), ``intact`` (``check_checkpoint``,
``latest_intact_checkpoint``) and ``export`` (``export_hf``).
"""

from __future__ import annotations

from fsdpfn.lazy import lazy_exports

# name -> the module that defines it; imported on first use (PEP 562), so that
# ``fsdpfn.checkpoint.files`` (the layout, latest_checkpoint) can be read without torch. The
# names outside ``__all__`` are the modules' shared helpers, reached this way by the unit tests
# and the checkpoint benchmark.
_SOURCES = {
    **dict.fromkeys(("export_hf", "_check_export_target", "_shard_bytes"),
                    "fsdpfn.checkpoint.export"),
    **dict.fromkeys(("FORMAT", "FORMAT_VERSION", "MANIFEST", "MARKER", "OWNER",
                     "clean_up_leftovers", "discard", "file_sizes", "is_complete",
                     "is_fsdpfn_checkpoint", "publish_dir", "rotate", "side_path",
                     "latest_checkpoint"), "fsdpfn.checkpoint.files"),
    **dict.fromkeys(("check_checkpoint", "latest_intact_checkpoint"), "fsdpfn.checkpoint.intact"),
    **dict.fromkeys(("check_files", "_resolve", "load_checkpoint"), "fsdpfn.checkpoint.load"),
    **dict.fromkeys(("_check_extra", "_check_save_args", "_to_save", "save_checkpoint"),
                    "fsdpfn.checkpoint.save"),
    "AsyncSave": "fsdpfn.checkpoint.save_async",
}

__all__ = ["save_checkpoint", "load_checkpoint", "export_hf", "latest_checkpoint",
           "latest_intact_checkpoint", "check_checkpoint", "AsyncSave", "MARKER", "MANIFEST",
           "FORMAT"]


__getattr__, __dir__ = lazy_exports(__name__, _SOURCES, __all__)
