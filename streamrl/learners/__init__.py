"""Many learners on one stream.

The generate pool serves one policy and produces a stream of scored groups; each learner (an
algorithm with its own copy of the model, optimizer and critic, on its own train worker) trains
on every group of it. Their ``[[learners]]`` tables are ``streamrl/recipe/learners.py``;
``fanout.py``: handing each step's groups to the learners that do not drive the run, and keeping
their failures theirs;
``runtime.py``: what the controller asks of them (placing, records, checkpoints, resume);
``control.py``: adding and removing learners while the run goes on;
``extension.py``: the side learners as a step extension; ``evaluate.py``: each learner's
held-out evaluation on its own worker; ``served.py``: each side learner's policy served beside
the run's (``serve.variants``).
"""
