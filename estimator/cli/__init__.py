"""The ``batchfit`` command line: ``main.py`` (the commands), ``plot.py`` (the memory timeline)."""
