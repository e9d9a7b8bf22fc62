"""The dataflow: the controller loop (client side) and the tasks it submits (worker side)."""
