"""What the Hugging Face adapters share: the config.json fields every kind writes, and the one-line
mismatch error the importer turns into a checkpoint error."""
from __future__ import annotations


class HFMismatch(ValueError):
    """A Hugging Face folder's config.json does not describe the run's [model]."""


def want(key: str, theirs, ours, ours_key: str, where: str) -> None:
    if theirs != ours:
        raise HFMismatch(f"{where} has {key} {theirs} but model.{ours_key} = {ours}")


def common_config(mcfg, dtype: str, eos: int | None) -> dict:
    """The config.json fields of every kind (hpengine's end-of-document token starts the next one)."""
    return {"vocab_size": mcfg.vocab_size, "tie_word_embeddings": bool(mcfg.tie_head), "torch_dtype": dtype,
            "use_cache": True, "bos_token_id": eos, "eos_token_id": eos}
