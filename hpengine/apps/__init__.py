"""After training: `hpengine eval` (evaluate.py), `hpengine generate` (generate.py) and `hpengine plot`
(plot.py). They build an engine or a model and never import the training loop.
Exports: plot_run (the others by module: apps.evaluate.evaluate, apps.generate.generate)."""
from hpengine.apps.plot import plot_run

__all__ = ["plot_run"]
