"""What a config becomes on N ranks, without MPI: resolve.resolve() -> Resolved (degrees, batch split, every
check that needs no communicator), the pipeline stage as data (stage.py), schedules as action lists
(schedules.py) and the activation-cache accounting engine and planner share (cache.py).
Exports: Resolved, build_stage, make_schedule."""
from hpengine.layout.resolve import Resolved
from hpengine.layout.schedules import make_schedule
from hpengine.layout.stage import build_stage

__all__ = ["Resolved", "build_stage", "make_schedule"]
