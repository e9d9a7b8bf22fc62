"""Built-in RL algorithms, one short file each."""
