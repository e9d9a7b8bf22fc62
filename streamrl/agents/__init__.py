"""Agents: multi-turn, tool-using rollouts written as a user's async function (or a gym-style
environment) that talk to the run's own OpenAI-compatible endpoint, trained token for token:
the rollouts on the agent pool (``rollout.py``), a gym-style Environment's rollout
(``environment.py``) and the step extension whose samples they are (``extension.py``). The
endpoint joins an agent's calls into its trajectory (``serve/trajectories.py``)."""
