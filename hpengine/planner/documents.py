"""Packed documents in the planner: the share of causal attention's score and value work a document mask
leaves, from a mean document length (`hpengine plan --mean-doc-len N`) or from a token file's real
document lengths (`--check` of a config with data.document_mask), and the facts the plan reports.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpengine.data.documents import length_summary, offsets_of
from hpengine.data.format import TokenFile
from hpengine.planner.cluster import PlanError


@dataclass(frozen=True)
class DocumentFacts:
    """What the plan assumes of the documents in a row of seq_len tokens. source: where the lengths come from;
    attention: expected visible (query, key) pairs under the mask over the causal T(T+1)/2, which scales the
    attention's FLOPs; cp_balance: the largest context-parallel rank's attention work over the mean under the
    cp split of packed rows (None: not modelled, the split's own function fills it)."""
    source: str
    attention: float
    summary: str = ""
    cp_balance: float | None = None


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


def from_mean(mean: float, T: int) -> DocumentFacts:
    check_mean(mean, T)
    return DocumentFacts(f"--mean-doc-len {mean:g} (geometric lengths)", attention_from_mean(mean, T))


def from_files(paths, weights, T: int) -> DocumentFacts:
    """The documents of token files blended by weight (the sampler's: a row picks its file by weight)."""
    total, fracs, summaries = sum(weights), [], []
    for path in paths:
        with TokenFile(path) as tf:
            offs = offsets_of(tf)
        fracs.append(attention_from_lengths(np.diff(offs), T))
        summaries.append(length_summary(offs) if len(paths) == 1 else f"{path}: {length_summary(offs)}")
    return DocumentFacts(f"measured from {', '.join(map(str, paths))}",
                         sum(w * f for w, f in zip(weights, fracs)) / total, "; ".join(summaries))


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
    cp = "not modelled yet" if d.cp_balance is None else f"{d.cp_balance:.3f} (largest rank / mean)"
    summary = f" ({d.summary})" if d.summary else ""
    return (f"documents: {d.source}{summary}: attention work {100 * d.attention:.1f}% of fully causal "
            f"(sum of L(L+1)/2 over T(T+1)/2); cp balance {cp}")
