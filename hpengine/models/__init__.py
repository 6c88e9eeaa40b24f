"""Models: parameter specs and block functions built from nn/. They never import MPI."""
from .common import LocalTP
from .gpt import GPT
from .llama import Llama
from .mlp import MLP


def build_model(mcfg, tp_size: int = 1):
    """The model object for a [model] config section (vocabulary padded to a multiple of tp_size)."""
    if mcfg.kind == "gpt":
        return GPT(mcfg, tp_size)
    if mcfg.kind == "llama":
        return Llama(mcfg, tp_size)
    if mcfg.kind == "mlp":
        return MLP(mcfg, tp_size)
    raise ValueError(f"model.kind = {mcfg.kind!r}: valid values are 'gpt', 'llama', 'mlp'")


__all__ = ["GPT", "Llama", "MLP", "LocalTP", "build_model"]
