"""Token data: the token-file format (format.py), building files from text (inputs.py, tokenizer.py,
build.py, builtin.py), reading them for training (dataset.py) and the Batch rows travel in (batch.py). No MPI
here: the engine decides which rank builds a corpus and which ranks read rows."""
from hpengine.data.batch import Batch
from hpengine.data.build import build_corpus
from hpengine.data.builtin import default_corpus_path, ensure_default_corpus
from hpengine.data.dataset import TokenDataset
from hpengine.data.format import DataError, TokenFile, token_dtype

__all__ = ["Batch", "DataError", "TokenDataset", "TokenFile", "build_corpus", "default_corpus_path", "ensure_default_corpus",
           "token_dtype"]
