"""A run: the step loop (controller), and around it the run's folder, checkpoints, deadline and end."""
