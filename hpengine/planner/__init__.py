"""The planner (`hpengine plan`): the layout search (search.py; islands.py: DiLoCo islands across sites), its
model of memory/traffic/time (model.py, tp.py, recompute.py, moe.py, gpu.py; sizes.py: MLA closed forms), the
machine it plans for (cluster.py, peaks.py, presets.py) and the calibration that measures one (calibrate.py,
calibrate_gpu.py). It never imports the engine.
Exports: Cluster, load_cluster (import the search and the model by module: planner.search, planner.model)."""
from hpengine.planner.cluster import Cluster, load_cluster

__all__ = ["Cluster", "load_cluster"]
