"""Models: parameter specs and block functions built from nn/. They never import MPI."""
from .common import LocalTP
from .gpt import GPT
from .mlp import MLP


def build_model(mcfg):
    """The model object for a [model] config section."""
    if mcfg.kind == "gpt":
        return GPT(mcfg)
    if mcfg.kind == "mlp":
        return MLP(mcfg)
    raise ValueError(f"model.kind = {mcfg.kind!r}: valid values are 'gpt', 'mlp'")


__all__ = ["GPT", "MLP", "LocalTP", "build_model"]
