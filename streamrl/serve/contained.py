"""The endpoint's outermost layer: a failure no check foresaw is that request's 500 in OpenAI's
shape, and ``/v1/`` answers 503 while the endpoint starts."""

from __future__ import annotations

import logging

from streamrl.serve.request_bodies import APIError
from streamrl.telemetry.text import printable

log = logging.getLogger("streamrl.serve")

#: Seconds a client is told to wait (``Retry-After``) while the endpoint starts.
RETRY_AFTER_S = 1


class Contained:
    """Whatever a request makes fail that no check foresaw is that request's 500, in OpenAI's
    shape, and one line in the worker's log -- not a traceback for every such call; and while the
    endpoint is starting, ``/v1/`` answers 503. Plain ASGI, not Starlette's ``BaseHTTPMiddleware``:
    under that one a route's ``request.is_disconnected()`` never saw a client that went away, so
    an abandoned request decoded to its end (and was trained on)."""

    def __init__(self, app, endpoint):
        self.app, self.endpoint = app, endpoint

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self.endpoint.ready and scope["path"].startswith("/v1/"):
            # not a 404 for a model it will serve in a moment: the client's usual retry finds it
            starting = APIError(503, "The endpoint is starting: it answers once every model it serves is ready "
                                     "(GET /health says when).", code="starting", kind="server_error",
                                headers={"Retry-After": str(RETRY_AFTER_S)})
            return await starting.response()(scope, receive, send)
        answered = False

        async def sending(message):
            nonlocal answered
            answered = answered or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:  # noqa: BLE001
            self.endpoint.traffic.count("server_errors")
            log.error("%s %s -> 500 %s: %s", scope["method"], printable(scope["path"]), type(exc).__name__,
                      printable(str(exc)[:300]))
            if answered:  # (mid-response: nothing else can be said; the connection ends)
                return
            failed = APIError(500, f"The server failed on this request ({type(exc).__name__}).", kind="server_error")
            await failed.response()(scope, receive, send)
