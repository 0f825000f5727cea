"""The out-of-memory error's account of the device: what this process holds against the rest."""

from __future__ import annotations

import torch

from fsdpfn.engine.runner import device_memory_note, memory_note

GIB = 2 ** 30


def test_another_process_holding_the_gpu_is_named():
    # an 80 GiB card: this process 30 GiB, a server on the same GPU 40 GiB, 10 GiB free
    note = memory_note(free=10 * GIB, total=80 * GIB, held=30 * GIB)
    assert "80.0 GiB in all" in note and "30.0 GiB held by this process" in note
    assert "40.0 GiB outside it" in note and "10.0 GiB free" in note
    assert "--decode-rows" in note and note.endswith(".")


def test_a_process_alone_on_its_gpu_gets_no_hint():
    note = memory_note(free=2 * GIB, total=80 * GIB, held=77 * GIB)
    assert "1.0 GiB outside it" in note and "--decode-rows" not in note


def test_without_cuda_the_note_is_empty():
    if torch.cuda.is_available():
        assert "GiB in all" in device_memory_note()
    else:
        assert device_memory_note() == ""
