"""An ASGI app served by uvicorn in a thread of this worker process, beside the engine it serves
from: the endpoint (``endpoint.py``) and the token servers of other engines
(``remote_engines.py``) start theirs here."""

from __future__ import annotations

import threading
import time


def start_in_thread(app, host: str, port: int, name: str, timeout_s: float = 30.0):
    """Serve ``app`` at ``host:port`` (0: a free port) from a daemon thread named ``name``;
    ``(server, thread, the port it listens on)``, or None when it could not listen within
    ``timeout_s`` (the port in use, an address not of this host). No lifespan events, no access
    log: the app holds no state that needs them, and requests are counted, not printed."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.time() + timeout_s
    while not server.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.02)
    if not server.started:
        server.should_exit = True
        return None
    return server, thread, server.servers[0].sockets[0].getsockname()[1]
