"""What runs on the workers: the functions Dask runs there to generate, score and train
(``task_functions.py``), to carry the weights from the trainer to the engines
(``weight_tasks.py``), to rank prompts (``ranker_tasks.py``) and to move running samples between
engines (``move_tasks.py``); the stateful objects a worker
holds between tasks (``resident.py``), and micro-batches cut to a token budget
(``microbatch.py``)."""
