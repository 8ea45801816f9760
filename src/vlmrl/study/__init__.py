"""`vlmrl compare`: studies of several arms and seeds (compare.py), each run a process of its own
that stops and continues with the study (processes.py)."""
