"""The ``torch_distributed`` transfer in one process (threads as the group's members): exact
delivery, and a missing receiver ends in a clear error within the timeout, not a hang."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from streamrl.transfer.torch_distributed import TorchDistributedConfig, TorchDistributedTransfer
from tests.helpers import check_every_sample_trained_once, read_records


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
    # two receivers come, the third generate worker is dead; each receiver gives up after its own
    # timeout (1 s and 3 s), so the first fails well before the second -- a receiver that
    # ignored its timeout would hang (the joins below only guard against that), and one that
    # failed at once, whatever its timeout, would fail as late as the other
    sender = TorchDistributedTransfer(TorchDistributedConfig(timeout_s=3))
    sender.receivers = 3
    token = sender.send(weights(), version=4)
    errors, took, order = {}, {}, []

    def receive(timeout_s):
        t0 = time.perf_counter()
        try:
            TorchDistributedTransfer(TorchDistributedConfig(timeout_s=timeout_s)).receive(token, 4)
        except RuntimeError as e:
            errors[timeout_s] = str(e)
        took[timeout_s] = time.perf_counter() - t0
        order.append(timeout_s)

    threads = [threading.Thread(target=receive, args=(t,)) for t in (1, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a receiver hung"
    for timeout_s in (1, 3):
        # the time it really waited, not only the limit
        waited = float(re.search(r"not received after ([\d.]+) s", errors[timeout_s]).group(1))
        assert abs(waited - took[timeout_s]) < 0.5, (waited, took)
        assert re.fullmatch(rf"torch_distributed transfer: version 4 from \S+ not received after [\d.]+ s "
                            rf"\(transfer.timeout_s = {timeout_s}\): its group failed \(\w+\); is every "
                            r"generate worker alive\?", errors[timeout_s]), errors
    # each waited its own timeout: the shorter one gave up first, neither before its limit
    assert order == [1, 3] and took[1] >= 0.95 and took[3] >= 2.95, (order, took)


@pytest.mark.slow
def test_a_run_publishes_through_torch_distributed_to_two_generate_workers(torch_distributed_run):
    # (conftest's run: two generate workers, two train workers; tests/test_security.py watched its sockets)
    proc = torch_distributed_run["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = read_records(torch_distributed_run["dir"])
    check_every_sample_trained_once(recs)
    # every sample of step s came from policy s: each generate worker loaded each broadcast
    assert all(x["version"] == r["step"] for r in recs for x in r["sample_log"])
    assert {x["worker"] for r in recs for x in r["sample_log"]} <= {"generate-0", "generate-1"}


def test_a_version_exported_after_a_newer_one_is_not_what_a_missed_receiver_is_sent_again():
    # an elastic join's export of the current weights can run after the next publication's on
    # the same train worker: the resend then served the older weights as the newest
    sender = TorchDistributedTransfer(TorchDistributedConfig(timeout_s=1))
    sender.receivers = 1
    newer, older = weights(), {n: t * 2 for n, t in weights().items()}
    sender.send(newer, version=6)
    sender.send(older, version=5)
    token, held = sender.resend(6)
    assert held == 6
    got = TorchDistributedTransfer(TorchDistributedConfig(timeout_s=30)).receive(token, 6)
    assert all(torch.equal(got[n], newer[n]) for n in newer)


def test_exports_from_two_threads_each_size_their_own_group(monkeypatch):
    # pools.train.threads > 1: the receivers of one export were set on the shared transfer, and
    # another export could change them before its send read them (a group of the wrong size:
    # every load missed it)
    from streamrl.on_worker import weight_tasks

    class Recorded:  # (stand-in for a transfer whose send is slow: it reads the receivers late)
        receivers = 0

        def send(self, weights, version):
            time.sleep(0.2)
            return self.receivers

    class Trainer:
        def named_weights(self):
            return {}

    transfer = Recorded()
    monkeypatch.setattr(weight_tasks, "expect", lambda *a: None)
    monkeypatch.setattr(weight_tasks, "resident", lambda name: transfer if name == weight_tasks.TRANSFER else Trainer())
    got = {}
    threads = [threading.Thread(target=lambda r=r: got.__setitem__(r, weight_tasks.export_weights(1, receivers=r)))
               for r in (1, 3)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(10)
    assert got == {1: 1, 3: 3}
