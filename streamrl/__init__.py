"""streamrl: disaggregated, streaming RL for LLMs on Dask.

Plugins import ``hookimpl`` from here::

    import streamrl

    @streamrl.hookimpl
    def register_rewards(): ...
"""

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("streamrl")

__all__ = ["hookimpl", "__version__"]
