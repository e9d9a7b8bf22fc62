"""The ``torch_distributed`` transfer in one process (threads as the group's members): exact
delivery, and a missing receiver ends in a clear error within the timeout, not a hang."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from streamrl.transfer.torch_distributed import TorchDistributedConfig, TorchDistributedTransfer


def weights():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(300, 70, generator=g), "b.bias": torch.randn(5, generator=g),
            "c.half": torch.randn(64, 3, generator=g).to(torch.bfloat16)}


def test_every_receiver_gets_bit_identical_weights_in_small_buckets():
    sent = weights()
    sender = TorchDistributedTransfer(TorchDistributedConfig(bucket_mb=0.01, timeout_s=30))
    sender.receivers = 2
    token = sender.send(sent, version=3)
    got = [None, None]

    def receive(i):
        got[i] = TorchDistributedTransfer(TorchDistributedConfig(bucket_mb=0.01, timeout_s=30)).receive(token, 3)

    threads = [threading.Thread(target=receive, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for out in got:
        assert out is not None and set(out) == set(sent)
        assert all(out[n].dtype == sent[n].dtype and torch.equal(out[n], sent[n]) for n in sent)


def test_a_receiver_that_never_comes_fails_the_others_within_the_timeout():
    sender = TorchDistributedTransfer(TorchDistributedConfig(timeout_s=2))
    sender.receivers = 2  # the second generate worker is dead
    token = sender.send(weights(), version=4)
    t0 = time.time()
    with pytest.raises(RuntimeError, match="version 4 from .* not received within 2 s"):
        TorchDistributedTransfer(TorchDistributedConfig(timeout_s=2)).receive(token, 4)
    assert time.time() - t0 < 20


@pytest.mark.slow
def test_a_run_publishes_through_torch_distributed_to_two_generate_workers(tiny_recipe, tmp_path):
    import json

    from tests.test_cli import check_every_sample_trained_once, streamrl

    proc = streamrl("recipe", "run", str(tiny_recipe), "--set", 'transfer={name="torch_distributed", timeout_s=60}',
                    "--set", "pools.generate.workers=2", "--set", "run.steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    check_every_sample_trained_once(recs)
    # every sample of step s came from policy s: each generate worker loaded each broadcast
    assert all(x["version"] == r["step"] for r in recs for x in r["sample_log"])
    assert {x["worker"] for r in recs for x in r["sample_log"]} <= {"generate-0", "generate-1"}
