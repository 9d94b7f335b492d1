"""The job's configuration: the typed sections, each key declared once with its default, range
and meaning (sections.py, algo.py), Hydra composition of their defaults with the shipped YAML
presets (composition.py), the one converter checking every value's type and range against its
declaration (bounds.py), the checks that span sections (job.py), --help's list and
docs/config-reference.md from the declarations (reference.py), loading the user's code a key names (plugins.py), a run's saved
config.yaml read as data (saved_run.py), the directory a run started in, which its relative
paths are read from (run_start.py), and whether this machine can hold the job at all (machine_fit.py).

The package itself imports nothing, so composing and checking overrides (``--help``, a
mistyped key) stays free of torch.
"""
