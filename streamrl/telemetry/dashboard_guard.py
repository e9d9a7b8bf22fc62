"""The dashboard's guard against other sites: it answers only its own host name and its own pages.

A web page on another site can point its own DNS name at 127.0.0.1 ("DNS rebinding") and then
read a loopback dashboard from the user's browser as same-origin; its requests carry that
foreign name as their ``Host``. A page elsewhere can also open the dashboard's websocket, which
browsers allow across sites, and read every figure it shows; its requests carry that site as
their ``Origin``. :func:`guard_host` makes the whole dashboard (Dask's pages too) refuse both with
403. It runs in the scheduler's process, on its event loop (``dashboard_app.attach`` calls it).

Tornado is imported inside the function: the client process imports this module only through
``dashboard_app``, to send ``attach`` by reference.
"""

from __future__ import annotations


def allowed_hosts(bound: str) -> set[str]:
    """The host names a dashboard bound to address ``bound`` answers to: that address, and
    ``localhost`` / ``127.0.0.1`` / ``::1``; bound to every interface (``0.0.0.0``, ``::``), also
    this machine's own names and addresses. An IP literal of the machine is never a rebinding."""
    names = {bound.strip("[]").lower(), "localhost", "127.0.0.1", "::1"}
    if names & {"", "0.0.0.0", "::"}:
        import socket

        import psutil

        names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        names |= {a.address.split("%", 1)[0].lower() for addrs in psutil.net_if_addrs().values() for a in addrs}
    return names


def guard_host(routing, server, scheduler=None) -> None:
    """Make the dashboard's tornado application (``routing``, served by ``server``) refuse with
    403 every request whose ``Host`` is not one of :func:`allowed_hosts` with the server's port
    (a DNS-rebinding page's requests, its websocket too), and every request whose ``Origin`` is
    another site (a page elsewhere opening the dashboard's websocket, which browsers allow across
    sites: it would read every figure the page shows). With ``scheduler``, ``/json/identity.json``
    answers from :func:`identity_json` (Dask's own handler fails on its workers' metrics). Once
    per application."""
    if getattr(routing, "streamrl_host_guard", False):
        return
    from urllib.parse import urlsplit

    from tornado import httputil, web

    class ForeignHost(web.RequestHandler):
        def prepare(self):
            self.set_status(403)
            self.finish("403: this dashboard answers its own host name only (Host header refused)\n")

    class ForeignOrigin(web.RequestHandler):
        def prepare(self):
            self.set_status(403)
            self.finish("403: this dashboard answers its own pages only (Origin header refused)\n")

    class Identity(web.RequestHandler):
        def get(self):
            self.set_header("Content-Type", "application/json")
            self.finish(identity_json(scheduler))

    names = allowed_hosts(str(getattr(server, "address", "") or ""))
    port = int(server.port)
    find = routing.find_handler

    def own(host: str | None, given: int | None, default: int) -> bool:
        return (host or "").strip("[]").lower() in names and (given if given is not None else default) == port

    def find_handler(request, **kwargs):
        host, given = httputil.split_host_and_port((request.host or "").lower())
        if not own(host, given, 80):
            return routing.get_handler_delegate(request, ForeignHost)
        origin = request.headers.get("Origin")
        if origin is not None:  # (a browser sends it with websockets and cross-site requests)
            try:
                parts = urlsplit(origin)
                ok = parts.scheme in ("http", "https") and own(parts.hostname, parts.port,
                                                               443 if parts.scheme == "https" else 80)
            except ValueError:
                ok = False
            if not ok:
                return routing.get_handler_delegate(request, ForeignOrigin)
        if scheduler is not None and request.path.endswith("/json/identity.json"):
            return routing.get_handler_delegate(request, Identity)
        return find(request, **kwargs)

    routing.find_handler = find_handler  # (tornado's router asks the application for a handler)
    routing.streamrl_host_guard = True


def identity_json(scheduler) -> str:
    """The scheduler's ``identity()`` as JSON. Dask's own ``/json/identity.json`` fails (500,
    and a traceback on the run's terminal) once workers have fetched data from each other: their
    metrics are keyed by tuples, which JSON cannot hold; here a tuple key becomes its parts
    joined by ``/``."""
    import json

    def keyed(value):
        if isinstance(value, dict):
            return {("/".join(map(str, k)) if isinstance(k, tuple) else k): keyed(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [keyed(v) for v in value]
        return value

    return json.dumps(keyed(scheduler.identity()), default=str)
