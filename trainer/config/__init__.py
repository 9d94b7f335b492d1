"""The job's configuration: Hydra composition of the shipped YAML (composition.py), the typed
sections (sections.py, algo.py) converted strictly from it (job.py), the bounds every number is checked
against first (bounds.py), loading the user's code a key names (plugins.py), a run's saved
config.yaml read as data (saved_run.py), the directory a run started in, which its relative
paths are read from (run_start.py), and whether this machine can hold the job at all (machine_fit.py).

The package itself imports nothing, so composing and checking overrides (``--help``, a
mistyped key) stays free of torch.
"""
