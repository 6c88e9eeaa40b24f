"""Models: one file per kind (gpt, llama, mlp) declaring its parameter specs and blocks, with layer pairs
built from nn/; common.py holds what the kinds share. They never import MPI: parallelism reaches them only
through the parallel context they are handed. Exports: GPT, Llama, MLP, LocalTP, build_model."""
from hpengine.models.common import LocalTP
from hpengine.models.gpt import GPT
from hpengine.models.llama import Llama
from hpengine.models.mlp import MLP


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
