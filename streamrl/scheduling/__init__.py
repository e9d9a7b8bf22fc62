"""Where each prompt group is generated and in what order: StreamRL's skewness-aware
dispatching (long-tail prompts on their own instances) and scheduling (longest first)."""
