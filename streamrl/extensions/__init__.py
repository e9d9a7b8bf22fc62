"""Step extensions: features that plug into the step loop at named moments (their contract is
``contracts/step_extension.py``): the elastic generate pool (``elastic.py``), held-out evaluation
(``evaluate.py``) and the mover of running samples (``sample_moves.py``). The side learners',
served traffic's and agent rollouts' extensions live beside what they call (``learners/``,
``serve/``, ``agents/``)."""
