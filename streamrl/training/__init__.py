"""Worker-side training: the policy, its optimizer, micro-batch accumulation, the step."""
