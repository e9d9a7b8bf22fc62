"""The ``cuda_ipc`` transfer on CPU: its packing, its bytes path (weights on the CPU, a worker
that cannot open the handle), and a run through it. The IPC path itself needs a GPU: the GPU
check (``benchmarks/gpu_check.py``) measures it."""

from __future__ import annotations

import socket

import pytest
import torch

from streamrl.api import ReceiveMissed
from streamrl.transfer.cuda_ipc import CudaIpcConfig, CudaIpcTransfer, pack, unpack
from tests.helpers import check_every_sample_trained_once, read_records, streamrl


def weights():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(30, 7, generator=g), "b.bias": torch.randn(5, generator=g),
            "c.half": torch.randn(6, 3, generator=g).to(torch.bfloat16)}


def test_packing_lays_every_tensor_end_to_end_in_one_buffer_and_unpacking_gives_views_of_it():
    w = weights()
    flat, layout = pack(w, torch.bfloat16)
    assert flat.dtype == torch.bfloat16 and flat.numel() == 210 + 5 + 18
    assert [(n, s, o) for n, s, o, _ in layout] == [("a.weight", (30, 7), 0), ("b.bias", (5,), 210),
                                                    ("c.half", (6, 3), 215)]
    back = unpack(flat, layout)
    for name, t in w.items():
        assert back[name].shape == t.shape and torch.equal(back[name], t.to(torch.bfloat16))
        assert back[name].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # views, no copy
    flat32, _ = pack({k: v for k, v in w.items() if v.dtype == torch.float32}, None)
    assert flat32.dtype == torch.float32  # as trained
    # as trained, a model of two dtypes: every tensor exactly, whichever comes first
    mixed = {"c.half": w["c.half"], "a.weight": w["a.weight"]}
    flat, layout = pack(mixed, None)
    assert flat.dtype == torch.float32 and all(torch.equal(unpack(flat, layout)[n].to(t.dtype), t) and
                                               torch.equal(unpack(flat, layout)[n], t.float()) for n, t in mixed.items())


def test_weights_on_the_cpu_cross_as_bytes_bit_for_bit():
    sender, receiver = CudaIpcTransfer(CudaIpcConfig()), CudaIpcTransfer(CudaIpcConfig())
    w = weights()
    payload = sender.send(w, 1)
    assert isinstance(payload, bytes)
    got = receiver.receive(payload, 1)
    assert all(torch.equal(got[n], t) and got[n].dtype == t.dtype for n, t in w.items())
    assert sender.send({}, 2) == b"" and receiver.receive(b"", 2) == {}


def test_a_handle_from_another_host_is_missed_and_sent_again_as_bytes_of_the_newest_buffer():
    transfer = CudaIpcTransfer(CudaIpcConfig(keep=2))
    foreign = {"host": "not-" + socket.gethostname(), "gpu": "GPU-x", "handle": (), "layout": []}
    with pytest.raises(ReceiveMissed, match=rf"weights v3 are on host not-{socket.gethostname()}, this worker"):
        transfer.receive(foreign, 3)
    with pytest.raises(RuntimeError, match="nothing was sent through CUDA IPC"):
        transfer.resend(3)
    # what send keeps on a GPU (a fake at the edge: no GPU here), three versions with keep = 2
    for v in (2, 3, 4):
        transfer._sent[v] = pack({n: t * v for n, t in weights().items()}, None)
        while len(transfer._sent) > transfer.config.keep:
            transfer._sent.popitem(last=False)
    payload, version = transfer.resend(3)
    assert version == 4 and sorted(transfer._sent) == [3, 4]
    got = transfer.receive(payload, version)
    assert torch.equal(got["a.weight"], (weights()["a.weight"] * 4))
    # every other worker that misses the same version gets the same bytes, made once
    made = []
    real = transfer._bytes
    transfer._bytes = lambda *a: made.append(1) or real(*a)
    assert transfer.resend(3) == (payload, 4) and transfer.resend(4)[0] is payload and made == []
    transfer._sent[5] = pack({n: t * 5 for n, t in weights().items()}, None)  # (a newer version: made anew)
    payload5, version = transfer.resend(5)
    assert version == 5 and made == [1] and payload5 != payload
    transfer.send({}, 6)  # (the next version sent: the bytes kept for a resend go)
    assert transfer._resent is None


@pytest.mark.slow
def test_a_run_with_slot_batching_and_the_cuda_ipc_transfer_trains_every_sample_once(tiny_recipe, tmp_path,
                                                                                    shared_cluster):
    proc = streamrl("recipe", "run", str(tiny_recipe), "--set", 'transfer.name="cuda_ipc"',
                    "--set", 'engine.batching="slots"', "--set", "engine.slots=8", "--set", "run.steps=3",
                    "--set", *shared_cluster.sets)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    recs = read_records(run_dir)
    check_every_sample_trained_once(recs)
    assert len(recs) == 3 and all(x["response_len"] >= 1 for r in recs for x in r["sample_log"])
