"""Secure by default: what a run opens to the network, what it reads back from its folder, who may
read that folder, and which Host headers the dashboard answers.

- Every socket a run's worker processes listen on (Dask's, the train pool's ``torch.distributed``
  store and gloo sockets, the ``torch_distributed`` transfer's store per weight version) is on
  127.0.0.1 on the embedded cluster: watched on a real run with two train workers.
- A crafted pickle placed in a checkpoint (``trainer.pt``, ``ranker.pt``, DCP's ``.metadata``),
  its manifest rewritten to match, never runs: the checkpoint is refused in one line.
- The run folder is the owner's alone (0o700), ``status.json`` too (0o600).
- The dashboard answers its own host and port (and localhost's) and refuses a foreign ``Host``
  header, as a DNS-rebinding page sends it.
"""

from __future__ import annotations

import os
import pickle
import shutil
import stat
from pathlib import Path

import psutil
import pytest

from streamrl.checkpoints import integrity
from tests.helpers import listeners_of, newest_usable, rewrite_manifest, sets, streamrl, write_tiny_recipe


# -- listeners ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_run_with_two_train_workers_and_torch_distributed_listens_on_loopback_only(torch_distributed_run):
    # (conftest's run: two train workers, two generate workers, the torch_distributed transfer)
    proc, seen = torch_distributed_run["proc"], torch_distributed_run["listeners"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    outside = sorted(s for s in seen if s[1] != "127.0.0.1")
    assert outside == [], outside  # before: train-0's store on '::' (every interface), for the whole run
    # the watch saw the run's sockets at all: Dask's in every process, and train-0's beyond
    # Dask's two (its comm and its HTTP server): the train pool's store and gloo's listeners
    per_process: dict[int, int] = {}
    for pid, _, _ in seen:
        per_process[pid] = per_process.get(pid, 0) + 1
    assert len(per_process) >= 5, per_process  # streamrl (with the scheduler) and the workers (five here)
    assert max(per_process.values()) >= 4, per_process


def test_the_torch_distributed_transfer_listens_on_the_workers_interface_only():
    import torch

    from streamrl.transfer.torch_distributed import TorchDistributedConfig, TorchDistributedTransfer

    before = listeners_of(psutil.Process())
    sender = TorchDistributedTransfer(TorchDistributedConfig(timeout_s=30))
    sender.receivers = 1
    sent = {"w": torch.arange(12.0).reshape(3, 4)}
    token = sender.send(sent, version=1)
    # the version's store waits for its receiver: it listens now, at the token's port
    store_port = int(token["address"].rsplit(":", 1)[1])
    during = listeners_of(psutil.Process()) - before
    assert {port for _, _, port in during} >= {store_port}
    assert {ip for _, ip, _ in during} == {"127.0.0.1"}, during
    got = TorchDistributedTransfer(TorchDistributedConfig(timeout_s=30)).receive(token, 1)
    assert torch.equal(got["w"], sent["w"])
    # gloo's own listeners (sender and receiver, this one process) on 127.0.0.1 too
    assert {ip for _, ip, _ in listeners_of(psutil.Process()) - before} <= {"127.0.0.1"}


def test_the_train_pools_store_listens_on_its_host_only():
    from streamrl.training import data_parallel

    address = data_parallel.free_address("127.0.0.1")
    host, port = address.rsplit(":", 1)
    # reserved: listening already, on 127.0.0.1 alone, until rank 0's join hands it to its store
    assert ("127.0.0.1", int(port)) in {(ip, p) for _, ip, p in listeners_of(psutil.Process())}
    import datetime

    store = data_parallel.store(host, int(port), 0, 1, datetime.timedelta(seconds=10),
                                data_parallel._RESERVED.pop(address))
    store.set("k", "v")
    mine = {(ip, p) for _, ip, p in listeners_of(psutil.Process())}
    assert ("127.0.0.1", int(port)) in mine and ("::", int(port)) not in mine and ("0.0.0.0", int(port)) not in mine
    assert data_parallel.interface_of("127.0.0.1") == "lo"


# -- nothing of a run folder is unpickled -----------------------------------------------------------
class Crafted:
    """A pickle that, once loaded, creates ``marker``: what a crafted checkpoint file would do
    with a shell command instead."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def craft(path: Path, marker: Path, torch_format: bool) -> None:
    """Replace ``path`` with a crafted pickle (in ``torch.save``'s zip format, or plain)."""
    if torch_format:
        import torch

        torch.save({"version": Crafted(marker)}, path)
    else:
        path.write_bytes(pickle.dumps(Crafted(marker)))


@pytest.fixture(scope="module")
def ranked_run(tiny_model, tmp_path_factory, shared_cluster) -> Path:
    """A finished run with checkpoints step-000002 and step-000004, each with ``ranker.pt`` (never
    modified: copy it)."""
    folder = tmp_path_factory.mktemp("security")
    recipe = write_tiny_recipe(folder, tiny_model)
    proc = streamrl("recipe", "run", str(recipe), "--set", "run.mode=batch", "--set", "run.steps=4",
                    "--set", "run.checkpoint_every=2", "--set", 'ranker.name="learned"',
                    "--set", 'scheduler.name="skew"', *sets(*shared_cluster.sets), "--plain", "--no-report")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (folder / "runs").iterdir()
    for step in ("step-000002", "step-000004"):
        assert (run / "checkpoints" / step / "ranker.pt").is_file()
    return run


@pytest.fixture
def run_copy(ranked_run, tmp_path) -> Path:
    copy = tmp_path / ranked_run.name
    shutil.copytree(ranked_run, copy)
    return copy


@pytest.mark.slow
def test_the_checkpoints_a_run_writes_load_without_full_unpickling(ranked_run):
    from streamrl.training.trainer_state import read_metadata, unsafe_torch_file

    for ckpt in sorted((ranked_run / "checkpoints").iterdir()):
        assert unsafe_torch_file(ckpt / "trainer" / "trainer.pt") is None
        assert unsafe_torch_file(ckpt / "ranker.pt") is None
        read_metadata(ckpt / "trainer" / "dcp")
        assert integrity.refused(ckpt) is None
    assert newest_usable(ranked_run) == (ranked_run / "checkpoints" / "step-000004", [])


@pytest.mark.slow
@pytest.mark.parametrize("where,torch_format,says", [
    ("trainer/trainer.pt", True, "trainer/trainer.pt holds objects other than tensors and plain values"),
    ("ranker.pt", False, "ranker.pt holds objects other than tensors and plain values"),
    ("trainer/dcp/.metadata", False, "trainer/dcp/.metadata names something DCP's metadata never holds"),
])
def test_a_crafted_pickle_in_a_checkpoint_is_refused_and_never_runs(run_copy, tmp_path, where, torch_format, says):
    marker = tmp_path / "crafted-pickle-ran"
    ckpt = run_copy / "checkpoints" / "step-000004"
    craft(ckpt / where, marker, torch_format)
    rewrite_manifest(ckpt)
    best, warned = newest_usable(run_copy)
    assert not marker.exists()
    assert best is not None and best.name == "step-000002"
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert warned[0].startswith(f"checkpoint step-000004 is not usable: {says}"), warned
    assert warned[0].endswith("using step-000002, the newest one that is")


@pytest.mark.slow
def test_a_resume_passes_over_a_crafted_trainer_pt_in_one_line_and_finishes(run_copy, tmp_path, shared_cluster):
    marker = tmp_path / "crafted-pickle-ran"
    ckpt = run_copy / "checkpoints" / "step-000004"
    craft(ckpt / "trainer" / "trainer.pt", marker, torch_format=True)
    rewrite_manifest(ckpt)
    proc = streamrl("recipe", "resume", str(run_copy), *sets("run.steps=5", *shared_cluster.sets), "--plain",
                    "--no-report")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not marker.exists()
    assert "Traceback" not in proc.stderr
    warned = [line for line in proc.stderr.splitlines() if line.startswith("streamrl: warning: checkpoint step-")]
    assert len(warned) == 1, proc.stderr
    assert warned[0].startswith("streamrl: warning: checkpoint step-000004 is not usable: trainer/trainer.pt holds "
                                "objects other than tensors and plain values; it was refused, since loading it "
                                "could run code"), warned
    assert "resumed from step-000002" in proc.stderr


@pytest.mark.slow
def test_a_resume_with_only_crafted_checkpoints_stops_in_one_line(run_copy, tmp_path):
    marker = tmp_path / "crafted-pickle-ran"
    for step in ("step-000002", "step-000004"):
        craft(run_copy / "checkpoints" / step / "trainer" / "trainer.pt", marker, torch_format=True)
        rewrite_manifest(run_copy / "checkpoints" / step)
    proc = streamrl("recipe", "resume", str(run_copy))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert not marker.exists()
    errors = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("streamrl: warning:")]
    assert len(errors) == 1 and errors[0].startswith(f"streamrl: error: {run_copy}: no usable checkpoint"), proc.stderr
    assert "it was refused, since loading it could run code" in errors[0]


def test_the_trainer_refuses_a_crafted_trainer_pt_itself(tmp_path):
    # the worker's own load is weights_only too, whatever the controller checked before
    from streamrl.training.trainer_state import unsafe_torch_file

    import torch

    marker = tmp_path / "ran"
    craft(tmp_path / "trainer.pt", marker, torch_format=True)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "trainer.pt", weights_only=True)
    assert unsafe_torch_file(tmp_path / "trainer.pt").startswith("trainer.pt holds objects other than tensors")
    assert not marker.exists()


# -- the run folder is its owner's -----------------------------------------------------------------
def test_a_run_folder_is_its_owners_alone_and_so_is_status_json(tiny_recipe):
    from streamrl.run.run_folder import RunFolder
    from streamrl.recipe.recipe import load_recipe

    old = os.umask(0o022)  # (the usual umask: without the chmod, 0o755 and 0o644)
    try:
        folder = RunFolder.create(load_recipe(tiny_recipe))
        folder.mark("running")
        folder.mark("completed")
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.path.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder.path / "status.json").stat().st_mode) == 0o600
    assert folder.status()["state"] == "completed"


@pytest.mark.slow
def test_a_real_runs_folder_is_its_owners_alone(ranked_run):
    assert stat.S_IMODE(ranked_run.stat().st_mode) == 0o700
    assert stat.S_IMODE((ranked_run / "status.json").stat().st_mode) == 0o600


# -- the dashboard answers its own name only --------------------------------------------------------
def status_of(port: int, path: str, host: str, origin: str | None = None) -> int:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers={"Host": host, **({"Origin": origin} if origin else {})})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_the_dashboard_refuses_a_foreign_host_header(scheduler_only):
    from streamrl.telemetry import dashboard

    url = dashboard.install(scheduler_only, name="demo", mode="async", steps=4)
    port = int(url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
    for path in ("/streamrl", "/status"):
        assert status_of(port, path, f"127.0.0.1:{port}") == 200
        assert status_of(port, path, f"localhost:{port}") == 200
        # a DNS-rebinding page's requests name its own host; another port is another origin
        assert status_of(port, path, "evil.example") == 403
        assert status_of(port, path, f"evil.example:{port}") == 403
        assert status_of(port, path, "127.0.0.1:1") == 403


def websocket_refusal(port: int, path: str, origin: str) -> str | None:
    """Open a websocket to the dashboard with tornado's client, as a page from ``origin`` would:
    None when the server accepts the handshake, else the refusal's status and body."""
    import asyncio

    from tornado.httpclient import HTTPClientError, HTTPRequest
    from tornado.websocket import websocket_connect

    async def go():
        request = HTTPRequest(f"ws://127.0.0.1:{port}{path}", headers={"Origin": origin})
        try:
            conn = await websocket_connect(request)
        except HTTPClientError as exc:
            body = exc.response.body.decode(errors="replace") if exc.response is not None and exc.response.body else ""
            return f"{exc.code} {body.strip()}"
        conn.close()
        return None

    return asyncio.run(go())


def test_the_dashboard_refuses_another_sites_origin_and_its_websockets(scheduler_only):
    from streamrl.telemetry import dashboard

    url = dashboard.install(scheduler_only, name="demo", mode="async", steps=4)
    port = int(url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
    own = f"http://127.0.0.1:{port}"
    refused = "403 403: this dashboard answers its own pages only (Origin header refused)"
    for path in ("/streamrl", "/status"):
        assert status_of(port, path, f"127.0.0.1:{port}", origin=own) == 200
        assert status_of(port, path, f"127.0.0.1:{port}", origin=f"http://localhost:{port}") == 200
        for other in ("http://evil.example", f"http://evil.example:{port}", "http://127.0.0.1:1", "null"):
            assert status_of(port, path, f"127.0.0.1:{port}", origin=other) == 403, (path, other)
    # Dask's and the page's websockets: another site's page gets no handshake (before: 101 and
    # the whole document); the page's own origin gets past the guard to Bokeh or Dask
    for ws in ("/streamrl/ws", "/individual-task-stream/ws"):
        assert websocket_refusal(port, ws, "http://evil.example") == refused
        assert websocket_refusal(port, ws, own) != refused


def test_the_dashboard_answers_identity_json_once_workers_have_fetched_from_each_other():
    # Dask's own handler fails on the tuple-keyed metrics a worker reports after it fetched data
    # from another (500, and a tornado traceback on the run's terminal)
    import json

    from distributed import Client, Scheduler, SpecCluster, Worker

    from streamrl.telemetry import dashboard

    workers = {n: {"cls": Worker, "options": {"nthreads": 1, "host": "127.0.0.1"}} for n in ("w0", "w1")}
    with SpecCluster(workers=workers, scheduler={"cls": Scheduler, "options": {
            "host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}}) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        a, b = list(cluster.scheduler.workers)
        x = client.submit(lambda: list(range(10_000)), workers=[a], pure=False)
        assert client.submit(len, x, workers=[b]).result() == 10_000  # b fetched x from a
        dashboard.install(client, name="demo", mode="async", steps=4)
        port = cluster.scheduler.http_server.port
        import http.client

        deadline = __import__("time").time() + 30
        while True:  # (the metrics reach the scheduler with the next heartbeat)
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/json/identity.json", headers={"Host": f"127.0.0.1:{port}"})
            response = conn.getresponse()
            body = response.read()
            conn.close()
            assert response.status == 200, body[:300]
            ident = json.loads(body)
            digests = [k for w in ident["workers"].values() for k in (w.get("metrics", {}).get(
                "digests_total_since_heartbeat") or {})]
            if any("/" in k for k in digests) or __import__("time").time() > deadline:
                break
        assert ident["type"] == "Scheduler" and len(ident["workers"]) == 2


@pytest.mark.parametrize("name, says", [
    (None, "trainer/dcp/.metadata names '{secret}', not a file inside its folder"),  # an absolute path
    ("../../../secret.bin", "trainer/dcp/.metadata names '../../../secret.bin', not a file inside its folder"),
    ("link.distcp", "trainer/dcp/link.distcp is a link, not a file"),
])
def test_dcp_metadata_that_names_a_file_outside_its_folder_is_refused(tmp_path, name, says):
    # DCP reads folder / relative_path: a checkpoint's metadata naming another file of the worker
    # would have it read into the weights (and served), with the manifest consistent around it
    import torch
    import torch.distributed.checkpoint as dcp

    secret = tmp_path / "secret.bin"
    secret.write_bytes(os.urandom(4096))
    ckpt = tmp_path / "run" / "step-000001"
    folder = ckpt / "trainer" / "dcp"
    dcp.save({"w": torch.ones(16)}, checkpoint_id=str(folder), no_dist=True)
    assert integrity.refused(ckpt) is None  # as DCP writes it
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # (our own file: trusted here)
    if name == "link.distcp":
        (folder / name).symlink_to(secret)
    for info in metadata.storage_data.values():
        info.relative_path = str(secret) if name is None else name
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    assert integrity.refused(ckpt) == says.format(secret=secret)
    # and a byte range past its file's end, however consistent the manifest
    for info in metadata.storage_data.values():
        info.relative_path, info.length = "__0_0.distcp", 1 << 40
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    assert integrity.refused(ckpt).startswith("trainer/dcp/__0_0.distcp is ")
