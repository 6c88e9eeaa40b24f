"""Unit tests for hpengine.params.buffers (ParamSpec, Layout, FlatBuffer, partition) and hpengine.params.init
(layout-invariant initialisation)."""
from __future__ import annotations

import itertools
from math import prod

import numpy as np
import pytest

from hpengine.params.buffers import FlatBuffer, Layout, ParamSpec, Range, imbalance, partition
from hpengine.params.init import init_flat, init_tensor


def specs_example():
    return [ParamSpec("a", (3, 4), tp_dim=1), ParamSpec("b", (5,), tp_dim=None, init="zeros"),
            ParamSpec("c", (2, 3, 2), tp_dim=0), ParamSpec("d", (1,), init="ones"),
            ParamSpec("e", (8, 6), tp_dim=0, std=0.5)]


# ---------------------------------------------------------------- ParamSpec

def test_tp_slices_and_local_shape():
    s = ParamSpec("w", (6, 8), tp_dim=1)
    assert s.tp_slices() == (slice(0, 6), slice(0, 8))
    assert s.tp_slices(0, 1) == (slice(0, 6), slice(0, 8))
    assert s.tp_slices(1, 4) == (slice(0, 6), slice(2, 4))
    assert s.tp_slices(3, 4) == (slice(0, 6), slice(6, 8))
    assert s.local_shape(2, 4) == (6, 2)
    assert ParamSpec("w", (6, 8), tp_dim=0).local_shape(1, 3) == (2, 8)
    assert ParamSpec("w", (6, 8), tp_dim=0).tp_slices(2, 3) == (slice(4, 6), slice(0, 8))
    # replicated tensors are whole on every tp rank
    rep = ParamSpec("b", (6,), tp_dim=None)
    assert rep.tp_slices(3, 4) == (slice(0, 6),) and rep.local_shape(3, 4) == (6,)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_tp_slices_tile_the_split_dim(size):
    s = ParamSpec("w", (3, 16), tp_dim=1)
    covered = [i for r in range(size) for i in range(*s.tp_slices(r, size)[1].indices(16))]
    assert covered == list(range(16))


def test_tp_slices_not_divisible_names_tensor_and_degree():
    s = ParamSpec("h.0.fc.w", (4, 6), tp_dim=1)
    with pytest.raises(ValueError, match=r"h\.0\.fc\.w.*6.*degree = 4"):
        s.tp_slices(0, 4)
    with pytest.raises(ValueError, match="not divisible"):
        s.local_shape(1, 4)


# ---------------------------------------------------------------- Layout / FlatBuffer

def test_layout_offsets_cover_total_once_in_spec_order():
    specs = specs_example()
    lay = Layout(specs)
    assert lay.names == [s.name for s in specs]
    assert lay.total == sum(prod(s.global_shape) for s in specs) == 12 + 5 + 12 + 1 + 48
    ranges = [lay.ranges[n] for n in lay.names]
    assert ranges[0].start == 0 and ranges[-1].stop == lay.total
    for prev, nxt in zip(ranges, ranges[1:]):
        assert prev.stop == nxt.start
    hits = np.zeros(lay.total, int)
    for n in lay.names:
        hits[lay.ranges[n].slice] += 1
        assert lay.ranges[n].size == prod(lay.shapes[n])
    assert (hits == 1).all()


def test_layout_uses_tp_local_shapes():
    lay = Layout(specs_example(), tp_rank=1, tp_size=2)
    assert lay.shapes == {"a": (3, 2), "b": (5,), "c": (1, 3, 2), "d": (1,), "e": (4, 6)}
    assert lay.total == 6 + 5 + 6 + 1 + 24
    with pytest.raises(ValueError, match="not divisible"):
        Layout(specs_example(), tp_rank=0, tp_size=4)   # "c" has 2 rows


def test_layout_rejects_duplicate_names():
    with pytest.raises(ValueError, match="duplicate.*'a'"):
        Layout([ParamSpec("a", (2,)), ParamSpec("b", (2,)), ParamSpec("a", (3,))])


def test_views_alias_the_flat_array():
    lay = Layout(specs_example())
    buf = FlatBuffer(lay, np, np.float64)
    assert buf["c"].shape == (2, 3, 2) and buf["a"].shape == (3, 4)
    buf["c"][1, 2, 0] = 7.0                      # view -> data
    assert buf.data[lay.ranges["c"].start + 1 * 6 + 2 * 2 + 0] == 7.0
    assert np.count_nonzero(buf.data) == 1
    buf.data[lay.ranges["e"].start + 6 * 3 + 5] = -2.0   # data -> view
    assert buf["e"][3, 5] == -2.0
    buf["a"] += 1.0                              # in-place add through __setitem__ keeps the alias
    assert (buf.data[lay.ranges["a"].slice] == 1.0).all()
    buf["b"] = np.arange(5.0)                    # assignment copies into the view, not a rebind
    assert (buf.data[lay.ranges["b"].slice] == np.arange(5.0)).all()
    assert np.shares_memory(buf["b"], buf.data)
    assert "b" in buf and "zz" not in buf
    buf.zero()
    assert not buf.data.any() and not buf["a"].any()


def test_flatbuffer_wraps_given_data_and_checks_its_shape():
    lay = Layout(specs_example())
    data = np.arange(lay.total, dtype=np.float32)
    buf = FlatBuffer(lay, np, np.float32, data=data)
    assert buf.data is data and buf["d"][0] == lay.ranges["d"].start
    for bad in (np.zeros(lay.total + 1), np.zeros(lay.total - 1), np.zeros((1, lay.total))):
        with pytest.raises(ValueError, match=rf"\({lay.total},\)"):
            FlatBuffer(lay, np, np.float64, data=bad)


def test_flatbuffer_dtype():
    buf = FlatBuffer(Layout(specs_example()), np, np.float32)
    assert buf.data.dtype == np.float32 and buf["e"].dtype == np.float32


def test_tensors_in():
    lay = Layout([ParamSpec("a", (4,)), ParamSpec("b", (2, 3)), ParamSpec("c", (5,))])  # 0-4-10-15
    assert list(lay.tensors_in(Range(0, 15))) == [("a", Range(0, 4), 0), ("b", Range(4, 10), 0),
                                                  ("c", Range(10, 15), 0)]
    assert list(lay.tensors_in(Range(2, 12))) == [("a", Range(2, 4), 2), ("b", Range(4, 10), 0),
                                                  ("c", Range(10, 12), 0)]
    assert list(lay.tensors_in(Range(5, 7))) == [("b", Range(5, 7), 1)]
    assert list(lay.tensors_in(Range(4, 10))) == [("b", Range(4, 10), 0)]   # boundaries touch nothing else
    assert list(lay.tensors_in(Range(15, 20))) == []


def test_range():
    r = Range(3, 9)
    assert r.size == 6 and r.slice == slice(3, 9)
    assert r.intersect(Range(5, 20)) == Range(5, 9)
    assert r.intersect(Range(9, 12)) is None and r.intersect(Range(0, 3)) is None


# ---------------------------------------------------------------- partition

def best_max_set(sizes, n):
    """Brute force: the smallest possible largest set over all contiguous splits into n non-empty sets."""
    m, best = len(sizes), None
    offs = np.concatenate([[0], np.cumsum(sizes)])
    for cuts in itertools.combinations(range(1, m), n - 1):
        b = (0, *cuts, m)
        worst = max(offs[b[i + 1]] - offs[b[i]] for i in range(n))
        best = worst if best is None else min(best, worst)
    return best


def check_tensor_partition(sizes, n):
    ranges = partition(sizes, n, "tensor")
    offs = set(np.concatenate([[0], np.cumsum(sizes)]).tolist())
    assert len(ranges) == n
    assert ranges[0].start == 0 and ranges[-1].stop == sum(sizes)
    for prev, nxt in zip(ranges, ranges[1:]):
        assert prev.stop == nxt.start                               # contiguous, in layer order
    for r in ranges:
        assert r.start in offs and r.stop in offs                   # whole tensors only
        assert r.size > 0                                           # every owner gets a tensor
    assert max(r.size for r in ranges) == best_max_set(sizes, n), (sizes, n, ranges)
    return ranges


@pytest.mark.parametrize("seed", range(40))
def test_tensor_partition_is_optimal_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, 9))
    # mixes of huge and tiny tensors, like embeddings next to layernorm biases
    sizes = [int(v) for v in rng.choice([1, 2, 3, 7, 16, 50, 100, 1000], size=m)]
    for n in range(1, m + 1):
        check_tensor_partition(sizes, n)


def test_tensor_partition_examples():
    assert partition([5], 1) == [Range(0, 5)]
    assert partition([4, 4, 4, 4], 2) == [Range(0, 8), Range(8, 16)]
    assert partition([10, 1, 1, 1, 1], 2) == [Range(0, 10), Range(10, 14)]
    assert partition([1, 1, 1, 10], 4) == [Range(0, 1), Range(1, 2), Range(2, 3), Range(3, 13)]
    check_tensor_partition([100, 1, 1, 1, 1, 1], 5)                 # fewer greedy sets than owners


def test_tensor_partition_more_owners_than_tensors():
    with pytest.raises(ValueError, match=r"degree 4 exceeds the number of tensors \(3\).*'flat'"):
        partition([1, 2, 3], 4, "tensor")


@pytest.mark.parametrize("total_sizes,n", [([10], 3), ([3, 4, 5], 2), ([7, 1, 1], 4), ([1000, 24], 7),
                                           ([2, 2], 1)])
def test_flat_partition_equal_ranges(total_sizes, n):
    total = sum(total_sizes)
    ranges = partition(total_sizes, n, "flat")
    assert len(ranges) == n and ranges[0].start == 0 and ranges[-1].stop == total
    for prev, nxt in zip(ranges, ranges[1:]):
        assert prev.stop == nxt.start
    sizes = [r.size for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == total


def test_flat_partition_may_cut_tensors():
    assert partition([3, 3], 3, "flat") == [Range(0, 2), Range(2, 4), Range(4, 6)]


def test_unknown_partition_mode():
    with pytest.raises(ValueError, match="'tensor', 'flat'"):
        partition([1, 2], 2, "layer")


def test_imbalance():
    assert imbalance([Range(0, 5), Range(5, 10)]) == 1.0
    assert imbalance([Range(0, 10), Range(10, 30)]) == pytest.approx(20 / 15)
    assert imbalance([Range(0, 9), Range(9, 10), Range(10, 11)]) == pytest.approx(9 / (11 / 3))
    assert imbalance([Range(0, 0), Range(0, 0)]) == 1.0


# ---------------------------------------------------------------- init

@pytest.mark.parametrize("tp_dim", [0, 1])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_init_tensor_tp_slices_equal_slices_of_the_whole(tp_dim, n):
    spec = ParamSpec("h.1.attn.qkv.w", (8, 12), tp_dim=tp_dim, std=0.7)
    full = init_tensor(spec, 42)
    assert full.shape == (8, 12) and full.dtype == np.float64
    parts = []
    for r in range(n):
        sl = spec.tp_slices(r, n)
        part = init_tensor(spec, 42, sl)
        assert part.shape == spec.local_shape(r, n)
        np.testing.assert_array_equal(part, full[sl])
        parts.append(part)
    np.testing.assert_array_equal(np.concatenate(parts, axis=tp_dim), full)


def test_init_tensor_arbitrary_slices_of_3d():
    spec = ParamSpec("t", (3, 5, 4))
    full = init_tensor(spec, 1)
    sl = (slice(1, 3), slice(2, 5), slice(0, 3))
    np.testing.assert_array_equal(init_tensor(spec, 1, sl), full[sl])


@pytest.mark.parametrize("shape", [(3 * 1024 + 5, 37), (200_001,), (2, 70_000)])
def test_init_tensor_made_in_chunks_equals_its_slices_and_is_standard_normal(shape):
    """A tensor larger than init's chunk: the whole equals every slice made on its own (other chunk
    boundaries, other first rows), and its values are standard normals * std (mean, variance, a tail)."""
    spec = ParamSpec("big", shape, std=0.5)
    full = init_tensor(spec, 7)
    rng = np.random.default_rng(0)
    for _ in range(4):
        lo = [int(rng.integers(0, n)) for n in shape]
        sl = tuple(slice(a, int(rng.integers(a + 1, n + 1))) for a, n in zip(lo, shape))
        np.testing.assert_array_equal(init_tensor(spec, 7, sl), full[sl])
    z = full.reshape(-1) / 0.5
    n = z.size
    assert abs(z.mean()) < 5 / np.sqrt(n) and abs(z.var() - 1) < 5 * np.sqrt(2 / n)
    assert abs(np.mean(np.abs(z) > 2) - 0.0455) < 5 * np.sqrt(0.0455 / n)      # P(|Z| > 2) of a normal


def test_init_flat_tp_layouts_hold_slices_of_the_one_process_tensors():
    specs = specs_example()[:1] + specs_example()[2:]     # all split dims divisible by 2
    whole = FlatBuffer(Layout(specs), np, np.float64)
    init_flat(whole, 5)
    for r in range(2):
        part = FlatBuffer(Layout(specs, tp_rank=r, tp_size=2), np, np.float64)
        init_flat(part, 5)
        for s in specs:
            np.testing.assert_array_equal(part[s.name], whole[s.name][s.tp_slices(r, 2)])


@pytest.mark.parametrize("start,stop", [(0, 78), (0, 1), (5, 20), (13, 14), (17, 30), (29, 31), (30, 78),
                                        (40, 41), (77, 78)])
def test_init_flat_over_a_range_equals_that_part_of_a_whole_init(start, stop):
    lay = Layout(specs_example())
    assert lay.total == 78
    whole = FlatBuffer(lay, np, np.float64)
    init_flat(whole, 9)
    part = FlatBuffer(lay, np, np.float64)
    part.data[...] = np.nan
    init_flat(part, 9, Range(start, stop))
    np.testing.assert_array_equal(part.data[start:stop], whole.data[start:stop])
    assert np.isnan(part.data[:start]).all() and np.isnan(part.data[stop:]).all()


def test_init_depends_on_seed_and_name_not_on_order():
    specs = specs_example()
    a = FlatBuffer(Layout(specs), np, np.float64)
    init_flat(a, 3)
    b = FlatBuffer(Layout(list(reversed(specs))), np, np.float64)
    init_flat(b, 3)
    for s in specs:
        np.testing.assert_array_equal(a[s.name], b[s.name])
    c = FlatBuffer(Layout(specs), np, np.float64)
    init_flat(c, 4)
    assert not np.isclose(a["a"], c["a"]).any() and not np.isclose(a["e"], c["e"]).any()
    same_shape = [ParamSpec("x", (6, 6)), ParamSpec("y", (6, 6))]
    vx, vy = (init_tensor(s, 3) for s in same_shape)
    assert not np.isclose(vx, vy).any()
    # a 1-element change of name is a different tensor as well
    assert not np.isclose(init_tensor(ParamSpec("h.1.w", (10,)), 0),
                          init_tensor(ParamSpec("h.11.w", (10,)), 0)).any()


def test_init_is_repeatable_and_cast_to_buffer_dtype():
    lay = Layout(specs_example())
    f64 = FlatBuffer(lay, np, np.float64)
    init_flat(f64, 11)
    again = FlatBuffer(lay, np, np.float64)
    init_flat(again, 11)
    np.testing.assert_array_equal(f64.data, again.data)
    f32 = FlatBuffer(lay, np, np.float32)
    init_flat(f32, 11)
    assert f32.data.dtype == np.float32
    np.testing.assert_array_equal(f32.data, f64.data.astype(np.float32))


def test_normal_init_statistics():
    spec = ParamSpec("big", (1000, 1000), std=0.05)
    v = init_tensor(spec, 2024)
    n = v.size
    assert abs(v.mean()) < 5 * 0.05 / np.sqrt(n)
    assert v.std() == pytest.approx(0.05, rel=5 / np.sqrt(2 * n))
    # shape of a normal: ~68.27% within one std, ~95.45% within two, symmetric
    assert abs(np.mean(np.abs(v) < 0.05) - 0.6827) < 0.003
    assert abs(np.mean(np.abs(v) < 0.10) - 0.9545) < 0.002
    assert abs(np.mean(v > 0) - 0.5) < 0.003
    assert np.isfinite(v).all()


def test_ones_zeros_and_unknown_init():
    ones = ParamSpec("ln.w", (4, 3), init="ones", tp_dim=1)
    zeros = ParamSpec("ln.b", (6,), init="zeros", tp_dim=0)
    assert (init_tensor(ones, 1) == 1.0).all() and init_tensor(ones, 1).shape == (4, 3)
    assert (init_tensor(zeros, 1) == 0.0).all() and init_tensor(zeros, 1).shape == (6,)
    assert init_tensor(ones, 1, ones.tp_slices(1, 3)).shape == (4, 1)
    lay = Layout([ones, zeros, ParamSpec("w", (2, 2))])
    buf = FlatBuffer(lay, np, np.float64)
    buf.data[...] = 5.0
    init_flat(buf, 0)
    assert (buf["ln.w"] == 1).all() and (buf["ln.b"] == 0).all() and (buf["w"] != 5).all()
    with pytest.raises(ValueError, match="tensor q: unknown init 'uniform'"):
        init_tensor(ParamSpec("q", (2,), init="uniform"), 0)


def test_init_key_and_spec_seed_override_name_and_run_seed():
    # several models in one buffer: "m1.wte" is keyed on "wte" with its own model's seed
    plain = ParamSpec("wte", (4, 6))
    prefixed = ParamSpec("m1.wte", (4, 6), init_key="wte", seed=8)
    np.testing.assert_array_equal(init_tensor(prefixed, 1234), init_tensor(plain, 8))
    np.testing.assert_array_equal(init_tensor(ParamSpec("m0.wte", (4, 6), init_key="wte"), 3),
                                  init_tensor(plain, 3))
    assert not np.isclose(init_tensor(prefixed, 1234), init_tensor(plain, 1234)).any()
    lay = Layout([prefixed, ParamSpec("m0.wte", (4, 6), init_key="wte", seed=7)])
    buf = FlatBuffer(lay, np, np.float64)
    init_flat(buf, 1234)
    np.testing.assert_array_equal(buf["m1.wte"], init_tensor(plain, 8))
    np.testing.assert_array_equal(buf["m0.wte"], init_tensor(plain, 7))
