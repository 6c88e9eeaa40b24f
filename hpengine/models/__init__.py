"""Models: one file per kind (gpt, llama, deepseek, mlp) declaring its parameter specs and blocks, with layer pairs
built from nn/; common.py holds what the kinds share. They never import MPI: parallelism reaches them only
through the parallel context they are handed (context.py); what a kind declares is interface.py. Exports: the
kind registry (KINDS, kind_of, hf_kinds), build_model, capabilities, the protocols, GPT, Llama, DeepSeek, MLP, the one-rank
context LOCAL, its Context type and its tp part LocalTP."""
from dataclasses import dataclass
from types import ModuleType

from hpengine.models import hf_deepseek, hf_gpt, hf_llama
from hpengine.models.context import LOCAL, Context, LocalTP
from hpengine.models.deepseek import DeepSeek
from hpengine.models.gpt import GPT
from hpengine.models.interface import Capabilities, Decoding, Model, Numerics, PlannerFacts
from hpengine.models.llama import Llama
from hpengine.models.mlp import MLP


@dataclass(frozen=True)
class Kind:
    """A model kind: its class and, where Hugging Face has an equivalent, its adapter module (hf_<kind>.py:
    ARCH (ARCHS, when it reads several), export_refusal, to_hf, hf_config, check_config, full_names, from_hf_map; REFUSED,
    optionally: near architectures it does not read, with why; bias_to_hf and bias_from_hf, optionally: the router's
    selection biases; copies, optionally: tensors a folder holds twice). Adding a kind is a file here and a line below."""
    model: type
    hf: ModuleType | None = None

    def hf_bias_out(self, bias, mcfg) -> dict:
        """The Hugging Face tensors of router biases `bias` ((n_layers, E) or None); {} where the adapter has none."""
        f = getattr(self.hf, "bias_to_hf", None)
        return {} if f is None else f(bias, mcfg)

    def hf_bias_in(self, get, mcfg, where: str):
        """The (n_layers, E) router biases of a folder whose tensors `get` reads; None where the adapter has none."""
        f = getattr(self.hf, "bias_from_hf", None)
        return None if f is None else f(get, mcfg, where)

    def hf_copies(self, mcfg) -> dict:
        """hpengine name -> [(HF name, transform)] of the folder's copies of that tensor; {} where there are none."""
        f = getattr(self.hf, "copies", None)
        return {} if f is None else f(mcfg)


KINDS = {"gpt": Kind(GPT, hf_gpt), "llama": Kind(Llama, hf_llama), "deepseek": Kind(DeepSeek, hf_deepseek), "mlp": Kind(MLP)}


def kind_of(name: str) -> Kind:
    if name not in KINDS:
        raise ValueError(f"model.kind = {name!r}: valid values are {', '.join(map(repr, KINDS))}")
    return KINDS[name]


def hf_kinds() -> dict:
    """Hugging Face architecture name -> model kind, for the kinds that have an adapter."""
    return {arch: name for name, k in KINDS.items() if k.hf is not None for arch in getattr(k.hf, "ARCHS", (k.hf.ARCH,))}


def hf_refused() -> dict:
    """Hugging Face architecture name -> why no kind reads it, for those an adapter names (its REFUSED)."""
    return {arch: why for k in KINDS.values() if k.hf is not None for arch, why in getattr(k.hf, "REFUSED", {}).items()}


def capabilities(mcfg) -> Capabilities:
    """What a model of this [model] config can do (attention, head widths, routed experts), without building it."""
    return kind_of(mcfg.kind).model.capabilities(mcfg)


def build_model(mcfg, tp_size: int = 1):
    """The model object for a [model] config section (vocabulary padded to a multiple of tp_size)."""
    return kind_of(mcfg.kind).model(mcfg, tp_size)


__all__ = ["DeepSeek", "GPT", "KINDS", "Kind", "LOCAL", "Capabilities", "Context", "Decoding", "Llama", "LocalTP", "MLP", "Model",
           "Numerics", "PlannerFacts", "build_model", "capabilities", "hf_kinds", "hf_refused", "kind_of"]
