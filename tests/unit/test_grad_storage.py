"""The gradient sync's protocol names nothing of precision, and the storage policies a sync is handed store
what they say: the plain one as computed, the bfloat16 ones rounded or as bits with exact float32 copies."""
from __future__ import annotations

import numpy as np

from hpengine.device.precision import round_bf16_
from hpengine.strategies.base import GradSync
from hpengine.strategies.grad_storage import PLAIN, Bf16Storage

WORDS = ("bf16", "bits", "fp16", "amp", "precision")


def _members(cls) -> set:
    """Every name the Protocol declares: methods, properties and annotated attributes."""
    names = {n for n in vars(cls) if not (n.startswith("__") and n.endswith("__"))}
    return names | set(getattr(cls, "__annotations__", {}))


def test_grad_sync_protocol_names_nothing_precision_specific():
    bad = sorted(n for n in _members(GradSync) if any(w in n.lower() for w in WORDS))
    assert not bad, f"GradSync members that belong to the precision side: {bad}"


def test_the_check_sees_the_protocol_members():
    assert {"grads_for", "grads_done", "reduce_grads", "owned", "param_dtype"} <= _members(GradSync)


def test_plain_storage_keeps_what_it_is_handed():
    a = np.array([1.0 + 2.0 ** -20, -3.0], dtype=np.float32)
    assert PLAIN.params(np, a) is a and PLAIN.param_values(np, a) is a
    assert PLAIN.param_dtype(np.float32) == PLAIN.grad_dtype(np.float32) == np.float32
    PLAIN.round_(np, a)
    assert a[0] == np.float32(1.0 + 2.0 ** -20) and not PLAIN.rounds and not PLAIN.encoded


def test_bf16_storage_rounds_or_encodes_exactly():
    a = np.array([1.0 + 2.0 ** -20, 1.0 + 3 * 2.0 ** -8, -3.0], dtype=np.float32)
    rounded = round_bf16_(np, a.copy())
    bits = Bf16Storage(param_bits=True, grads="bits")
    assert bits.param_dtype(np.float32) == bits.grad_dtype(np.float32) == np.uint16 and bits.encoded
    stored = np.zeros(3, dtype=np.uint16)
    bits.encode(np, a, stored)
    assert np.array_equal(bits.decode(np, stored), rounded)
    assert np.array_equal(bits.param_values(np, bits.params(np, a)), rounded)
    values = Bf16Storage(param_bits=False, grads="rounded")
    assert values.params(np, a) is a and values.grad_dtype(np.float32) == np.float32 and not values.encoded
    g = a.copy()
    values.round_(np, g)
    assert np.array_equal(g, rounded)
    kept = a.copy()
    Bf16Storage(param_bits=False).round_(np, kept)      # float32 gradients: sums stored as computed
    assert np.array_equal(kept, a)
