"""The dataflow, client side: what the step loop submits and where (topology, submission,
dispatch, modes, weights, placement). What runs on the workers is ``streamrl/on_worker/``."""
