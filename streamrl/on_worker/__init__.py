"""What runs on the workers: the functions Dask runs there (``task_functions.py``), the stateful
objects a worker holds between tasks (``resident.py``), and micro-batches cut to a token budget
(``microbatch.py``)."""
