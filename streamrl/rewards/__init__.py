"""Built-in rewards: they score one response to one prompt."""
