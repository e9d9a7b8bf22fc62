"""Agents: multi-turn, tool-using rollouts written as a user's async function (or a gym-style
environment) that talk to the run's own OpenAI-compatible endpoint, trained token for token."""
