"""What keeps a run safe: fail before step 1, survive faults, save and resume exactly, raise alarms.

    preflight.py          before step 1: first batches, prompt lengths, memory and disk, settled once
    early_checks.py       before anything loads: task, tools, trackers, model source
    activation_memory.py  the training pass's activation memory, measured on a small probe
    faults.py             NaN/inf updates skipped, stop signals turned into a checkpoint
    checkpoint.py         checkpoints written whole or not at all, and the exact resume
    folder_lock.py        one process at a time in a run (or study) folder
    alarms.py             warnings a person should read while the run goes on

May import: rollout, models, report, tasks, config, disk, errors. Nothing from training or
evaluation.
"""
