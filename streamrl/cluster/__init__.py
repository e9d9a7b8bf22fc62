"""The cluster a run uses: starting one (the embedded cluster, a factory's) or connecting to one
someone else started, and stopping it (``lifecycle.py``); what makes a worker one of a pool's
(``pool_workers.py``); workers forked from a warm server (``warm_start.py``, the server's quick
exit ``warm_server.py``); ``cluster.factory``
(``factories.py``); a cluster streamrl did not start (``attach.py``); what Dask prints, kept for
the user (``quiet.py``)."""
