"""StreamRL's output-length ranker: predict which prompts will have the longest outputs."""
