"""Packed documents in the planner: the share of causal attention's score and value work a document mask
leaves, from a mean document length (`hpengine plan --mean-doc-len N`) or from a token file's real
document lengths (`--check` of a config with data.document_mask), and the facts the plan reports.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpengine.data.documents import length_summary, offsets_of, window_documents
from hpengine.data.format import TokenFile
from hpengine.nn.context_split import document_work, imbalance, split_work
from hpengine.planner.cluster import PlanError


@dataclass(frozen=True)
class DocumentFacts:
    """What the plan assumes of the documents in a row of seq_len tokens. source: where the lengths come from;
    attention: expected visible (query, key) pairs under the mask over the causal T(T+1)/2, which scales the
    attention's FLOPs; cp_balance: per cp degree, the busiest context-parallel rank's attention work over the
    mean with each document split head-tail (what runs) and with each packed row split head-tail, on sampled
    rows (cp_balance_of)."""
    source: str
    attention: float
    summary: str = ""
    cp_balance: tuple = ()      # ((cp, per-document split, head-tail per row), ...)


def visible_pairs(lengths) -> int:
    """(query, key) pairs a row of documents of these lengths attends: each sees its own earlier tokens and
    itself, sum of L(L+1)/2 (a fully causal row of T tokens: T(T+1)/2)."""
    n = np.asarray(lengths, dtype=np.int64)
    return int((n * (n + 1) // 2).sum())


# A row is a window of seq_len tokens starting anywhere in the packed stream, so it cuts the documents at both
# ends. Its expected visible pairs are sum over lags k < T of (T - k) pairs at lag k times the chance that two
# tokens k apart sit in one document. From a file's lengths L_d (n tokens in all) that chance is
# sum_d max(0, L_d - k) / n (a token drawn uniformly from the stream). From a mean N alone the lengths are
# taken as geometric with mean N (a boundary after each token with chance 1/N, the discrete exponential):
# the chance is (1 - 1/N)^k.
def _window_pairs(same, T: int) -> float:
    k = np.arange(T, dtype=np.float64)
    return float(((T - k) * same).sum())


def attention_from_lengths(lengths, T: int) -> float:
    """Expected visible pairs of a window of T tokens of the stream over T(T+1)/2 (see the comment above)."""
    n = np.sort(np.asarray(lengths, dtype=np.int64))
    if n.size == 0 or n.sum() == 0:
        raise PlanError("no documents to measure")
    k = np.arange(T)
    # sum_d max(0, L_d - k): the lengths above k, less k for each of them
    at = np.searchsorted(n, k, side="right")
    above = np.concatenate([np.cumsum(n[::-1])[::-1], [0]])[at] - k * (n.size - at)
    return _window_pairs(above / n.sum(), T) / (T * (T + 1) / 2)


def attention_from_mean(mean: float, T: int) -> float:
    """attention_from_lengths for geometric lengths of mean `mean` (see the comment above)."""
    return _window_pairs((1.0 - 1.0 / mean) ** np.arange(T, dtype=np.float64), T) / (T * (T + 1) / 2)


def check_mean(mean, T: int) -> None:
    """--mean-doc-len must be a number of tokens in [1, seq_len]."""
    if not (isinstance(mean, (int, float)) and 1 <= mean <= T):
        raise PlanError(f"--mean-doc-len {mean:g}: must be a mean document length in tokens, 1 <= N <= "
                        f"model.seq_len = {T}")


# The cp balance is measured, not modelled: CP_ROWS windows of T tokens drawn from the documents (the file's
# stream at seeded random starts, or a stream of geometric lengths), split by nn/context_split's functions.
CP_ROWS = 64
CP_DEGREES = (2, 4, 8)


def _geometric_offsets(mean: float, tokens: int, rng) -> np.ndarray:
    n = max(1, int(2 * tokens / mean) + 16)
    lengths = rng.geometric(1.0 / mean, size=n) if mean > 1 else np.ones(n, dtype=np.int64)
    while lengths.sum() <= tokens:
        lengths = np.concatenate([lengths, lengths])
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _windows(offsets: np.ndarray, rows: int, T: int, rng):
    """(segments, positions) of `rows` windows at random starts of the stream (fewer tokens than a window:
    none)."""
    last = int(offsets[-1]) - T - 1
    if rows <= 0 or last < 0:
        return None
    seg, pos, _ = window_documents(offsets, rng.integers(0, last + 1, rows), T)
    return seg, pos


def cp_balance_of(streams, T: int) -> tuple:
    """streams: [(offsets, rows)] -> ((cp, per-document, head-tail per row), ...) for the cp degrees whose
    head-tail chunks divide T."""
    rng = np.random.default_rng(0)
    got = [w for w in (_windows(o, n, T, rng) for o, n in streams) if w is not None]
    if not got:
        return ()
    seg, pos = (np.concatenate([w[i] for w in got]) for i in (0, 1))
    return tuple((cp, imbalance(split_work(seg, pos, cp)), imbalance(document_work(pos, cp)))
                 for cp in CP_DEGREES if T % (2 * cp) == 0)


def from_mean(mean: float, T: int) -> DocumentFacts:
    check_mean(mean, T)
    offsets = _geometric_offsets(mean, CP_ROWS * T + T + 1, np.random.default_rng(0))
    return DocumentFacts(f"--mean-doc-len {mean:g} (geometric lengths)", attention_from_mean(mean, T),
                         cp_balance=cp_balance_of([(offsets, CP_ROWS)], T))


def from_files(paths, weights, T: int) -> DocumentFacts:
    """The documents of token files blended by weight (the sampler's: a row picks its file by weight)."""
    total, fracs, summaries, streams = sum(weights), [], [], []
    for path, w in zip(paths, weights):
        with TokenFile(path) as tf:
            offs = offsets_of(tf)
        fracs.append(attention_from_lengths(np.diff(offs), T))
        summaries.append(length_summary(offs) if len(paths) == 1 else f"{path}: {length_summary(offs)}")
        streams.append((np.asarray(offs, dtype=np.int64), round(CP_ROWS * w / total)))
    return DocumentFacts(f"measured from {', '.join(map(str, paths))}",
                         sum(w * f for w, f in zip(weights, fracs)) / total, "; ".join(summaries),
                         cp_balance_of(streams, T))


def documents_of(cfg, mean=None) -> DocumentFacts | None:
    """The plan's documents: --mean-doc-len when given; else, under data.document_mask, the lengths of the
    config's token files (data.path or data.sources); else None (one document a row)."""
    T = cfg.model.seq_len
    if mean is not None:
        return from_mean(mean, T)
    if not cfg.data.document_mask:
        return None
    if cfg.data.path:
        return from_files([cfg.data.path], [1.0], T)
    if cfg.data.sources:
        return from_files([s.path for s in cfg.data.sources], [s.weight for s in cfg.data.sources], T)
    return None


def line(d: DocumentFacts | None) -> str:
    """The plan's line on documents: where their lengths come from and the attention work they leave."""
    if d is None:
        return ""
    cp = ", ".join(f"cp {n} {a:.3f} ({b:.3f})" for n, a, b in d.cp_balance) or "not measured (rows too short)"
    summary = f" ({d.summary})" if d.summary else ""
    return (f"documents: {d.source}{summary}: attention work {100 * d.attention:.1f}% of fully causal "
            f"(sum of L(L+1)/2 over T(T+1)/2); cp balance, busiest rank / mean with each document split "
            f"head-tail (each packed row split head-tail) on {CP_ROWS} sampled rows: {cp}")
