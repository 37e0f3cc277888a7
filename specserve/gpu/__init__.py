"""The GPU check (`make gpu-check`, `python -m specserve.gpu.check`): the engine on one GPU, checked and
timed (check.py), on models built here from configs (models.py), each step in a process of its own if
asked (steps.py), tensor parallelism over two GPUs (tp.py)."""
