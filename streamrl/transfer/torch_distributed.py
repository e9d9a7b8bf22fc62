"""The ``torch_distributed`` transfer: a collective broadcast from the train worker to every
generate worker, so the weights never pass through Dask.

Each publication gets its own small process group (a ``TCPStore`` on the train worker at a fresh
port, then ``ProcessGroupGloo`` over the train worker and the ``receivers`` generate workers):
``send`` snapshots the weights, opens the store and returns at once with a token (address,
bucket layout) that Dask carries to the loads; a background thread broadcasts the weights in
buckets of ``bucket_mb`` while each generate worker's ``receive`` joins the group and fills its
buffers. A group per version keeps no state between publications, so a generate worker restarted
in between simply joins the next one. Every collective has ``timeout_s``: a receiver that never
comes (a dead worker) fails the others' loads with one line, never a hang.

A member lost mid-publication (a generate worker killed) breaks the group at once: gloo sees its
sockets close, so the others' broadcasts fail within moments, not after ``timeout_s``. They raise
:class:`ReceiveMissed`, as does a receiver that comes to a group already gone or full (the
restarted worker running the load it had been given), and streamrl fetches the weights again
for that worker alone: :meth:`TorchDistributedTransfer.resend` serves the newest snapshot
over a group of two (the train worker keeps the last one it sent for that: one CPU copy of the
weights). The next publication's group has only the generate workers up at that moment.

A member lost while the group's sockets connect is another matter: gloo keeps trying to reach
it until its timeout, and was seen to stay in that connect for good. So each receiver runs gloo
in a thread and watches its group from outside it, on a store connection of its own: it beats
(a counter in the store) every second, and gives up, with :class:`ReceiveMissed`, when another
member's beat stands still while the group forms, when a member has not come ``join_within_s``
after this one (its worker died before it took its place, or could not reach the store), when
the sender's store has closed (the sender failed), or when nothing moved for ``timeout_s``.

The store and gloo's sockets listen on the interface of the worker's Dask address only (127.0.0.1
on the embedded cluster), as the train pool's group does (``training/data_parallel.py``).

Gloo carries CPU tensors; a CUDA deployment would use NCCL the same way.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time

from pydantic import BaseModel, ConfigDict, Field

from streamrl.api import ReceiveMissed, Transfer

log = logging.getLogger(__name__)


#: Seconds a receiver gives a group's store to answer it (joining; the group then forms
#: within ``timeout_s``).
STORE_ANSWER_S = 15.0

#: Seconds between a receiver's looks at its group (is the sender's store still open?).
WATCH_EVERY_S = 1.0

#: Seconds a receiver waits for its broadcasts to end after the sender's store closed: a sender
#: that succeeded closes it while its last bytes arrive (milliseconds); one that failed, for good.
SENDER_GONE_S = 5.0


def _store_client(host: str, port: int, world: int, answer_s: float):
    """A client of the group's store at ``host:port``, connected within ``answer_s`` seconds
    (``TimeoutError`` if not). torch's own deadline is not one: it retries a connection that
    timed out after a backoff, so a store that does not answer held a receiver about twice its
    timeout (31.9 s for 15 s, seen in CI). Connecting claims nothing in the store (the rank is
    taken after), so a connection given up on here that succeeds later is only dropped."""
    import torch.distributed as dist

    made: dict = {}

    def connect() -> None:
        try:
            made["store"] = dist.TCPStore(host, port, world, False, timeout=datetime.timedelta(seconds=answer_s))
        except Exception as exc:  # (raised below, in the caller's thread)
            made["error"] = exc

    thread = threading.Thread(target=connect, name=f"streamrl-store-{port}", daemon=True)
    thread.start()
    thread.join(answer_s)
    if "error" in made:
        raise made["error"]
    if "store" not in made:
        raise TimeoutError(f"no answer within {answer_s:g} s")
    return made["store"]


class TorchDistributedConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    bucket_mb: float = Field(64.0, gt=0)
    """Megabytes per broadcast: fewer collectives against a bounded extra buffer."""
    timeout_s: float = Field(120.0, gt=0, le=1e6)  # (bounded: a timer of 1e300 s cannot be armed)
    """Seconds every member waits for the others (group set-up and each broadcast)."""
    join_within_s: float = Field(30.0, gt=0, le=1e6)  # (bounded: a timer of 1e300 s cannot be armed)
    """Seconds a receiver in a forming group waits for a member that has not come at all (a
    generate worker killed before it took its place, or one whose store connection failed):
    past it, the members that came get the weights from the train worker one by one
    (``resend``) instead of waiting ``timeout_s`` for it. A member only late (its worker busy
    with long generations) costs those resends, nothing else."""


def _store_open(host: str, port: int) -> bool:
    """Whether the group's store still accepts connections (the sender holds it while its
    broadcasts run)."""
    try:
        socket.create_connection((host, port), timeout=WATCH_EVERY_S).close()
        return True
    except OSError:
        return False


def _buckets(layout: list[tuple[str, list[int], str]], bucket_bytes: float) -> list[list[int]]:
    """Indices of ``layout`` entries grouped into buckets of about ``bucket_bytes`` (same dtype)."""
    import torch

    out, current, size, dtype = [], [], 0, None
    for i, (_, shape, dt) in enumerate(layout):
        n = torch.Size(shape).numel() * torch.empty(0, dtype=getattr(torch, dt)).element_size()
        if current and (size + n > bucket_bytes or dt != dtype):
            out.append(current)
            current, size = [], 0
        current.append(i)
        size, dtype = size + n, dt
    if current:
        out.append(current)
    return out


def _host() -> str:
    """The interface this Dask worker listens on (the group meets where Dask already talks)."""
    from streamrl.training.data_parallel import own_host

    return own_host()


#: Store key prefix of a receiver's heartbeat: a counter it adds to every :data:`WATCH_EVERY_S`
#: while it receives, and sets to ``done`` when it leaves the group whole.
BEAT = "streamrl-beat-"

#: Seconds another member's heartbeat may stand still, while this receiver's group forms, before
#: it counts that member as lost (a worker killed mid-join: gloo would wait its whole timeout).
MEMBER_SILENT_S = 10.0


class _Watch:
    """A receiver's view of its group from outside gloo, on a store connection of its own: it
    beats for its rank and looks at the others' beats and at the sender's store."""

    def __init__(self, host: str, port: int, rank: int, world: int, join_within_s: float):
        self.host, self.port, self.rank, self.world = host, port, rank, world
        self.join_within_s = join_within_s
        self.since = time.monotonic()  # (this member came: the others have join_within_s from here)
        self.store = None
        self.heard: dict[int, tuple[bytes, float]] = {}  # rank -> (its last beat, when it changed)
        self.closed_since: float | None = None

    def look(self, forming: bool) -> str:
        """Beat once; why the group is lost ("" while it is not): the sender's store closed for
        :data:`SENDER_GONE_S`, or, while the group forms, a member silent for :data:`MEMBER_SILENT_S`
        or not come ``join_within_s`` after this one."""
        now = time.monotonic()
        # the sender lets the store go when its broadcasts end, done or failed: done, the last
        # bytes are arriving here; failed, this group is over whatever gloo waits for
        if not _store_open(self.host, self.port):
            self.closed_since = self.closed_since or now
            if now - self.closed_since > SENDER_GONE_S:
                return "its sender left the group (its store closed)"
            return ""
        self.closed_since = None
        try:
            if self.store is None:
                self.store = _store_client(self.host, self.port, self.world, 5 * WATCH_EVERY_S)
            self.store.add(f"{BEAT}{self.rank}", 1)
            if not forming:  # (formed: gloo sees a member's sockets close, at once)
                return ""
            for r in range(1, self.world):
                if r == self.rank:
                    continue
                if not self.store.check([f"{BEAT}{r}"]):  # (a member takes its place and beats at once)
                    if now - self.since > self.join_within_s:
                        return (f"member {r} of its group of {self.world} did not come within "
                                f"{self.join_within_s:g} s (transfer.join_within_s)")
                    continue
                beat = self.store.get(f"{BEAT}{r}")
                last = self.heard.get(r)
                if beat == b"done" or last is None or last[0] != beat:
                    self.heard[r] = (beat, now)
                elif now - last[1] > MEMBER_SILENT_S:
                    return f"member {r} of its group of {self.world} went silent while the group formed"
        except Exception as exc:  # (the store going: the next look sees it closed)
            log.debug("torch_distributed transfer: a look at the store failed: %s", exc)
        return ""

    def leave(self, whole_on=None) -> None:
        """Drop the connection; ``whole_on``: a store client (the one gloo is done with) to say
        that this member left whole, so that its beat standing still is no loss."""
        try:
            if whole_on is not None:
                whole_on.set(f"{BEAT}{self.rank}", "done")
        except Exception:  # noqa: BLE001 -- the sender may have let the store go already
            pass
        self.store = None


class TorchDistributedTransfer(Transfer):
    """Weights broadcast over a gloo process group per version."""

    def __init__(self, config: TorchDistributedConfig):
        self.config = config
        self.latest: tuple | None = None
        """``(version, snapshot, layout)`` of the newest version sent (train worker), for a
        receiver that missed its group (:meth:`resend`)."""

    def _group(self, store, rank: int, world: int):
        import torch.distributed as dist

        # gloo's own sockets on this worker's interface: by default gloo listens on whatever the
        # machine's host name resolves to, which may be reachable from outside the machine
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=_host())]
        options._timeout = datetime.timedelta(seconds=self.config.timeout_s)
        return dist.ProcessGroupGloo(store, rank, world, options)

    def send(self, weights, version: int) -> dict:
        """Snapshot the weights, open this version's group and broadcast in the background;
        returns the token the generate workers need."""
        if not weights:
            return {}
        names = list(weights)
        snapshot = [weights[n].detach().to("cpu").clone() for n in names]  # the trainer may step on
        layout = [(n, list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in zip(names, snapshot)]
        if self.latest is None or version >= self.latest[0]:  # (an elastic join's export of an older one: not newest)
            self.latest = (version, snapshot, layout)  # for a receiver that misses its group (resend)
        return self._serve(snapshot, layout, version, 1 + self.receivers)

    def resend(self, version: int) -> tuple[dict, int]:
        """Serve the newest snapshot sent (``version`` or later) to one receiver alone, over a
        group of two; returns the token and the version it holds."""
        latest = self.latest
        if latest is None or latest[0] < version:
            held = "nothing" if latest is None else f"version {latest[0]}"
            raise RuntimeError(f"torch_distributed transfer: version {version} cannot be sent again: this "
                               f"worker holds {held} (was the train worker restarted?)")
        sent, snapshot, layout = latest
        return self._serve(snapshot, layout, sent, 2), sent

    def _serve(self, snapshot: list, layout: list, version: int, world: int) -> dict:
        """Open a store for a group of ``world`` and broadcast ``snapshot`` from a thread."""
        import torch
        import torch.distributed as dist

        from streamrl.training.data_parallel import listen

        host = _host()
        listener = listen(host)  # (torch's store would listen on every interface, not only host's)
        port = listener.getsockname()[1]
        fd = listener.detach()
        try:
            store = dist.TCPStore(host, port, world, True, timeout=datetime.timedelta(seconds=self.config.timeout_s),
                                  wait_for_workers=False, master_listen_fd=fd)
        except BaseException:
            try:  # (detached: nothing else closes it, unless torch took it and closed it already)
                os.close(fd)
            except OSError:
                pass
            raise

        def broadcast():
            t0 = time.perf_counter()
            try:
                group = self._group(store, 0, world)
                for idx in _buckets(layout, self.config.bucket_mb * 2**20):
                    flat = torch.cat([snapshot[i].reshape(-1) for i in idx])
                    opts = dist.BroadcastOptions()
                    opts.rootRank = 0
                    group.broadcast([flat], opts).wait()
            except Exception as exc:  # the receivers say so in their loads; this is the sender's view
                log.warning("torch_distributed transfer: version %s not sent to its group of %d after %.1f s "
                            "(%s: %s)", version, world, time.perf_counter() - t0, type(exc).__name__,
                            str(exc).splitlines()[0][:200] if str(exc) else "")
            # the group and the store go with this frame: a late receiver finds the port closed

        threading.Thread(target=broadcast, name=f"streamrl-broadcast-v{version}", daemon=True).start()
        return {"address": f"{host}:{port}", "world": world, "layout": layout}

    def receive(self, payload: dict, version: int) -> dict:
        """Join this version's group and receive every bucket; returns the named tensors. Raises
        :class:`ReceiveMissed` (how long it tried, and why) when the group is gone, full or
        broke, or did not form within ``timeout_s``."""
        if not payload:
            return {}
        import torch
        import torch.distributed as dist

        host, port = payload["address"].rsplit(":", 1)
        timeout = datetime.timedelta(seconds=self.config.timeout_s)
        t0 = time.perf_counter()

        def missed(why: str) -> ReceiveMissed:
            return ReceiveMissed(f"torch_distributed transfer: version {version} from {payload['address']} not "
                                 f"received after {time.perf_counter() - t0:.1f} s "
                                 f"(transfer.timeout_s = {self.config.timeout_s:g}): {why}")

        # A group already over has closed its store: say so now. (torch's store client would
        # retry a refused connection for the whole timeout.)
        try:
            socket.create_connection((host, int(port)), timeout=min(5.0, self.config.timeout_s)).close()
        except OSError:
            raise missed("its group is over (a worker restarted since it was published?)") from None
        # A live store answers in moments; one whose group just ended may still hold its port
        # open without answering (measured: a late receiver waited 207 s), so joining gets a short
        # deadline, and only the group's forming the whole timeout.
        try:
            store = _store_client(host, int(port), payload["world"], min(STORE_ANSWER_S, self.config.timeout_s))
            rank = int(store.add("streamrl-next-rank", 1))  # 1 .. receivers, in arrival order
            if rank < payload["world"]:
                store.add(f"{BEAT}{rank}", 1)  # (at once: a member killed from here on is seen silent)
            store.set_timeout(timeout)
        except Exception as exc:
            raise missed(f"its store did not answer ({type(exc).__name__})") from None
        if rank >= payload["world"]:  # every place taken: this worker replaces one that left
            raise missed(f"its group of {payload['world']} was full")
        # gloo runs in a thread of its own, watched from here (:class:`_Watch`): a member killed
        # while the group's sockets connect leaves the others in gloo's connect until its timeout,
        # and was seen to leave one there for good, after the sender had failed and let its store
        # go. A receive that gives up leaves that thread blocked in gloo until the worker ends.
        progress = [time.monotonic(), False]  # (last progress, whether the group has formed)
        done: dict = {}

        def join_and_receive() -> None:
            try:
                group = self._group(store, rank, payload["world"])
                progress[:] = [time.monotonic(), True]
                layout, out = payload["layout"], {}
                for idx in _buckets(layout, self.config.bucket_mb * 2**20):
                    dtype = getattr(torch, layout[idx[0]][2])
                    shapes = [torch.Size(layout[i][1]) for i in idx]
                    flat = torch.empty(sum(s.numel() for s in shapes), dtype=dtype)
                    opts = dist.BroadcastOptions()
                    opts.rootRank = 0
                    group.broadcast([flat], opts).wait()
                    progress[0] = time.monotonic()
                    offset = 0
                    for i, shape in zip(idx, shapes):
                        out[layout[i][0]] = flat[offset:offset + shape.numel()].view(shape)
                        offset += shape.numel()
                done["weights"] = out
            except Exception as exc:
                done["error"] = exc

        thread = threading.Thread(target=join_and_receive, name=f"streamrl-receive-v{version}", daemon=True)
        thread.start()
        watch = _Watch(host, int(port), rank, payload["world"], self.config.join_within_s)
        try:
            while True:
                thread.join(WATCH_EVERY_S)
                if not thread.is_alive():
                    break
                if time.monotonic() - progress[0] > self.config.timeout_s + WATCH_EVERY_S:  # (gloo's own, missed)
                    raise missed("its group did not form, or a broadcast did not end, within the timeout; "
                                 "is every generate worker alive?")
                why = watch.look(forming=not progress[1])
                if why:
                    raise missed(f"{why}; is every generate worker alive?")
        finally:
            watch.leave(whole_on=store if "weights" in done else None)
        if "error" in done:
            # a member gone mid-way fails at once (gloo sees its sockets close); one that never
            # came fails after timeout_s: the elapsed time tells them apart
            raise missed(f"its group failed ({type(done['error']).__name__}); is every generate worker alive?")
        return done["weights"]
