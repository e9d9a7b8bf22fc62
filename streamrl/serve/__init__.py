"""Serve and learn: the OpenAI-compatible endpoint on a generate worker (``openai_api.py``, its
routes ``routes.py``, its request bodies and errors ``request_bodies.py``, its answers ``responses.py`` and their bodies
``response_bodies.py``; run there by ``endpoint.py``), one request's choices in the engine (``completion.py``), the served
completions waiting for rewards and steps (``traffic.py``), and the step extension that makes
them a run's samples (``extension.py``), an agent's calls joined into one token-faithful
trajectory (``trajectories.py``), and a token server beside an engine on another worker, which
the endpoint streams from (``remote_engines.py``); both run uvicorn in a thread of the worker
(``http_server.py``). The ``[serve]`` table is ``recipe/serve.py``."""
