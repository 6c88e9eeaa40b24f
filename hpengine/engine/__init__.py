"""The engine: one rank's model stage, its strategies and one optimizer step read top to bottom
(engine.py); the rank's training state as data for checkpoints (state.py).
Exports: Engine, NonFiniteError."""
from hpengine.engine.engine import Engine, NonFiniteError

__all__ = ["Engine", "NonFiniteError"]
