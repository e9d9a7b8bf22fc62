"""Built-in tasks (prompt sources) and the tiny models made for them."""
