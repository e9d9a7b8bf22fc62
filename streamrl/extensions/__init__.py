"""Step extensions: features that plug into the step loop at named moments
(``step_extension.py``): the elastic generate pool (``elastic.py``) and held-out evaluation
(``evaluate.py``). The side learners' extension is ``learners/extension.py``, beside the
learners it calls."""
