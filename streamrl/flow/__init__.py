"""The dataflow: what the step loop submits (client side) and the tasks it runs (worker side)."""
