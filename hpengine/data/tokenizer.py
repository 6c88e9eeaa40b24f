"""Tokenizers of a build: bytes, a Hugging Face tokenizer.json, or a byte-level BPE trained here.
Owns the TokenizerSpec a build and its workers share, loading and training, and the Encoder that cuts long
documents at line starts and appends eos after every document."""
from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from hpengine.data.format import BYTES, DataError, sha256_text, token_dtype

#   bytes            the UTF-8 bytes are the ids (vocab 256); eos is 0, the NUL byte, which never occurs
#                    in a text document (a NUL byte marks a file binary)
#   tokenizer.json   anything Hugging Face tooling saves (BPE, Unigram, WordPiece, WordLevel); its vocab
#                    is get_vocab_size(with_added_tokens=True) (or one past its largest id, if larger);
#                    eos is the given eos token, else the first of EOS_CANDIDATES the tokenizer knows
#   trained          a byte-level BPE (ByteLevel pre-tokenizer and decoder, the 256 byte symbols as initial
#                    alphabet) with "<|endoftext|>" as its one special token and eos
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
TRAINED_EOS = "<|endoftext|>"
BYTES_EOS = 0


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything a build (or a worker process) needs to tokenize: picklable, built once."""
    text: str                  # "bytes", or the tokenizer's JSON text
    eos_id: int
    vocab_size: int
    kind: str                  # "bytes", "BPE", "Unigram", "WordPiece", "WordLevel"
    line_cuts: bool = True     # a document may be encoded in pieces cut at line starts

    @property
    def sha256(self) -> str:
        return sha256_text(self.text)

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab_size)

    def attrs(self) -> dict:
        return {"vocab_size": self.vocab_size, "eos_id": self.eos_id, "tokenizer": self.text,
                "tokenizer_sha256": self.sha256}


BYTES_SPEC = TokenizerSpec(BYTES, BYTES_EOS, 256, "bytes")


def kind_of(text: str | None) -> str:
    """The model type of a tokenizer attribute: "bytes", "BPE", ..., or "none"."""
    if text is None:
        return "none"
    if text == BYTES:
        return "bytes"
    try:
        return str(json.loads(text)["model"]["type"])
    except (ValueError, KeyError, TypeError):
        return "unknown"


def _hf():
    import tokenizers
    return tokenizers


def from_json(text: str, origin: str, eos_token: str | None = None) -> TokenizerSpec:
    """The spec of a tokenizer given as JSON text; `origin` names it in errors."""
    try:
        json.loads(text)
    except ValueError as e:
        raise DataError(f"tokenizer '{origin}' is not valid JSON ({e}): expected a tokenizer.json saved "
                        "by Hugging Face tokenizers or transformers") from None
    try:
        tok = _hf().Tokenizer.from_str(text)
    except Exception as e:                  # noqa: BLE001 - tokenizers raises plain Exception
        raise DataError(f"tokenizer '{origin}' is not a Hugging Face tokenizer ({e}): expected a "
                        "tokenizer.json saved by Hugging Face tokenizers or transformers") from None
    ids = tok.get_vocab(with_added_tokens=True).values()
    vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
    if eos_token is not None:
        eos_id = tok.token_to_id(eos_token)
        if eos_id is None:
            special = sorted(t.content for t in tok.get_added_tokens_decoder().values() if t.special)
            raise DataError(f"--eos-token {eos_token!r} is not a token of tokenizer '{origin}': expected one "
                            f"of its tokens, e.g. a special token ({', '.join(special) or 'it has none'})")
    else:
        found = [i for i in map(tok.token_to_id, EOS_CANDIDATES) if i is not None]
        if not found:
            raise DataError(f"tokenizer '{origin}' has none of the end-of-text tokens "
                            f"{', '.join(EOS_CANDIDATES)}: pass --eos-token with the token that ends a document")
        eos_id = found[0]
    text = tok.to_str()
    return TokenizerSpec(text, int(eos_id), int(vocab_size), kind_of(text), _line_cuts_are_exact(tok))


# A long document is encoded in pieces cut at line starts (after a newline between two non-space
# characters, where pre-tokenizers split anyway), which bounds memory (tokenizers holds ~200 bytes per
# token while encoding) and spreads the document over threads and workers. Only for tokenizers that give
# the ids of the whole text for such pieces, which a probe checks at load time: byte-level BPE and
# whitespace pre-tokenizers do; one that prefixes every input (a Metaspace adding "▁") does not, and its
# documents are encoded whole.
LINE_START = re.compile(r"(?<=\S)\n(?=\S)")       # a lone newline between two non-space characters
_PROBE = ("Hello world, it's 12 o'clock.\nThe quick brown fox\n  jumps over\tthe lazy dog!\nÉtienne a "
          "dit : « ça va » 😀\n\tdef f(x):\nreturn x  \r\nEND\n\n42\n'tis\n")


def _line_cuts_are_exact(tok) -> bool:
    """Whether encoding pieces cut at line starts gives the ids of the whole text."""
    tok.encode_special_tokens = True
    cuts = [0] + [m.end() for m in LINE_START.finditer(_PROBE)] + [len(_PROBE)]
    pieces = [_PROBE[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    whole = tok.encode(_PROBE, add_special_tokens=False).ids
    return whole == [i for e in tok.encode_batch(pieces, add_special_tokens=False) for i in e.ids]


def cut_at_lines(text: str, size: int) -> list[str]:
    """`text` in pieces of at least `size` characters (the last may be shorter), each but the last
    ending just before a line start; one piece when there is no line start to cut at."""
    pieces, start = [], 0
    while len(text) - start > size:
        m = LINE_START.search(text, start + size - 1)
        if m is None:
            break
        pieces.append(text[start:m.end()])
        start = m.end()
    pieces.append(text[start:])
    return pieces


def load(name: str | Path, eos_token: str | None = None) -> TokenizerSpec:
    """The spec of --tokenizer NAME: "bytes" or the path of a tokenizer.json."""
    if str(name) == BYTES:
        if eos_token is not None:
            raise DataError(f"--eos-token {eos_token!r} does not apply to the bytes tokenizer (its eos is "
                            "the NUL byte, 0): pass it with --tokenizer PATH/tokenizer.json")
        return BYTES_SPEC
    path = Path(name)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = "no such file" if not path.exists() else str(e)
        raise DataError(f"tokenizer '{path}' cannot be read ({why}): expected 'bytes' or the path of a "
                        "tokenizer.json") from None
    return from_json(text, str(path), eos_token)


def train_bpe(texts: Iterable[str], vocab_size: int, progress: bool = False) -> TokenizerSpec:
    """A byte-level BPE of at most `vocab_size` ids trained on `texts` (fewer when the texts run out
    of pairs to merge)."""
    check_bpe_vocab(vocab_size)
    hf = _hf()
    tok = hf.Tokenizer(hf.models.BPE())
    tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = hf.decoders.ByteLevel()
    trainer = hf.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[TRAINED_EOS], show_progress=progress,
                                     initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return from_json(tok.to_str(), "trained BPE", TRAINED_EOS)


def check_bpe_vocab(vocab_size) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 257:
        raise DataError(f"--vocab-size {vocab_size} is too small for a byte-level BPE: expected an integer "
                        ">= 257 (the 256 byte symbols and <|endoftext|>)")


def sample(texts: Iterable[str], how: float | int | None) -> Iterator[str]:
    """A deterministic sample of the documents: all (None), a fraction (a float in (0, 1]: documents
    spread evenly by a fixed hash of their index), or a number of them (an int: a reservoir sample
    with a fixed seed, held in memory)."""
    if how is None:
        yield from texts
    elif isinstance(how, float):
        # the fractional parts of i * golden ratio are spread evenly over [0, 1)
        yield from (t for i, t in enumerate(texts) if (i * 0.6180339887498949) % 1.0 < how)
    else:
        rng, kept = np.random.default_rng(0), []
        for i, t in enumerate(texts):
            if i < how:
                kept.append(t)
            else:
                j = int(rng.integers(0, i + 1))
                if j < how:
                    kept[j] = t
        yield from kept


def check_sample(how) -> float | int | None:
    """Validates --tokenizer-sample: a fraction in (0, 1] or a number of documents >= 1."""
    if how is None:
        return None
    given = how
    if isinstance(how, str):
        try:
            how = int(how)
        except ValueError:
            try:
                how = float(how)
            except ValueError:
                how = None
    if isinstance(how, bool) or not (isinstance(how, int) and how >= 1 or isinstance(how, float) and 0 < how <= 1):
        raise DataError(f"--tokenizer-sample {given} is invalid: expected a fraction of the documents in "
                        "(0, 1] such as 0.1, or a number of documents >= 1 such as 10000")
    return how


# Documents are encoded without the tokenizer's own special tokens (add_special_tokens=False) and with a
# special token's text inside a document encoded as plain text, so eos_id appears only where the build
# appends it: after every document. The token file stores the tokenizer's JSON text (Tokenizer.to_str()),
# enough to decode it later with tokenizers.Tokenizer.from_str.
class Encoder:
    """Encodes batches of documents into one flat array of ids with eos after each document."""

    def __init__(self, spec: TokenizerSpec, threads: bool = True):
        self.spec, self._tok = spec, None
        if spec.text != BYTES:
            if not threads:                    # one process of several: no thread pool of its own
                os.environ["TOKENIZERS_PARALLELISM"] = "false"
            self._tok = _hf().Tokenizer.from_str(spec.text)
            self._tok.encode_special_tokens = True    # a special token's text in a document is text

    def encode(self, texts: list[str], ends: list[bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(tokens of the spec's dtype, int64 length of each text): eos follows every text that ends a
        document (ends[i], default all) and counts in its length."""
        spec = self.spec
        ends = [True] * len(texts) if ends is None else ends
        if self._tok is None:
            data = [t.encode("utf-8") + (b"\0" if e else b"") for t, e in zip(texts, ends)]
            lengths = np.fromiter(map(len, data), dtype=np.int64, count=len(data))
            return np.frombuffer(b"".join(data), dtype=np.uint8), lengths
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)   # fast: no offsets
        ids = [e.ids + [spec.eos_id] if end else e.ids
               for e, end in zip(encode(texts, add_special_tokens=False), ends)]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
        top = int(tokens.max()) if tokens.size else -1
        if top >= spec.vocab_size:
            raise DataError(f"the tokenizer produced id {top} >= its vocab size {spec.vocab_size}: its "
                            "tokenizer.json is inconsistent")
        return tokens.astype(spec.dtype), lengths


_worker: Encoder | None = None


def init_worker(spec: TokenizerSpec) -> None:
    """Process-pool initializer: the tokenizer is built once per worker."""
    global _worker
    _worker = Encoder(spec, threads=False)


def encode_in_worker(texts: list[str], ends: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    return _worker.encode(texts, ends)
