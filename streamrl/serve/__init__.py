"""Serve and learn: the OpenAI-compatible endpoint on a generate worker (``openai_api.py``, run
there by ``endpoint.py``), one request's choices in the engine (``completion.py``), the served
completions waiting for rewards and steps (``traffic.py``), and the step extension that makes
them a run's samples (``extension.py``). The ``[serve]`` table is ``recipe/serve.py``."""
