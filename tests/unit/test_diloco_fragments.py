"""DiLoCo's streaming fragments: groups of whole tensors in the model's order, balanced by global element count
(hand-worked examples), each rank's slices of them under tp and sharding, and the refusal of more fragments than
the model has tensors."""
import pytest

from hpengine.config.load import load_config
from hpengine.layout.resolve import LayoutError, resolve
from hpengine.params.buffers import Layout, ParamSpec, Range, packed
from hpengine.planner.diloco import fragment_pieces
from hpengine.strategies.diloco import fragment_of, fragment_slices

TINY = ["model.kind=gpt", "model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.seq_len=8",
        "train.global_batch=8", "strategy.diloco.enable=true", "strategy.diloco.replicas=2",
        "strategy.diloco.inner_steps=40"]


def specs(*sizes):
    return [ParamSpec(f"t{i}", (n,)) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("sizes,F,want", [
    ((4, 4, 2, 2, 4), 1, [0, 0, 0, 0, 0]),
    ((4, 4, 2, 2, 4), 2, [0, 0, 1, 1, 1]),        # 8 | 8: the only cut with no group above 8
    ((4, 4, 2, 2, 4), 3, [0, 1, 1, 2, 2]),        # 4 | 6 | 6: the only cut with no group above 6
    ((1, 1, 1, 20), 2, [0, 0, 0, 1]),             # 3 | 20: a tensor is never split
    ((5, 5, 5), 3, [0, 1, 2]),                    # one tensor each
])
def test_groups_of_whole_tensors_in_order(sizes, F, want):
    of = fragment_of(specs(*sizes), F)
    assert [of[f"t{i}"] for i in range(len(sizes))] == want


def test_groups_count_the_unpadded_elements():
    """A tensor padded for tp counts its true elements: 2 + 6 | 5 (padded, 8 | 6 + 5 would be the cut)."""
    sp = [ParamSpec("a", (8,), true_shape=(2,)), ParamSpec("b", (6,)), ParamSpec("c", (5,))]
    assert fragment_of(sp, 2) == {"a": 0, "b": 0, "c": 1}


def test_slices_are_this_ranks_pieces_of_the_fragments_tensors():
    """tp rank 1 of 2: w (4, 2) split on dim 0 holds 4 elements at [0, 4), b (2,) whole at [4, 6), v (2, 4) split on
    dim 1 holds 4 at [6, 10); w in fragment 0, b and v in fragment 1. Owning flat [3, 8): w's [3, 4) is owned
    [0, 1), b's owned [1, 3), v's [6, 8) owned [3, 5), one slice per tensor; owning [0, 2) and [6, 10): b in none."""
    lay = Layout([ParamSpec("w", (4, 2), tp_dim=0), ParamSpec("b", (2,)), ParamSpec("v", (2, 4), tp_dim=1)],
                 tp_rank=1, tp_size=2)
    of = {"w": 0, "b": 1, "v": 1}
    assert fragment_slices(packed([Range(3, 8)]), lay, of, 2) == [[(0, 1)], [(1, 3), (3, 5)]]
    assert fragment_slices(packed([Range(0, 2), Range(6, 10)]), lay, of, 2) == [[(0, 2)], [(2, 6)]]
    assert fragment_slices(packed([Range(4, 6)]), lay, of, 3) == [[], [(0, 2)], []]


def test_planner_moves_each_owned_tensor_piece_uncut():
    """The planner's pieces of tensors 4, 4, 2, 2, 4 owned over [3, 11): 1 of the first, 4, 2, 1 of the fourth, each
    whole (no fragment edge inside a tensor), in the stage's groups 4 | 6 | 6; more fragments than the stage has
    tensors leave the extra calls empty."""
    assert fragment_pieces(3, 11, (4, 4, 2, 2, 4), 3) == [[1], [4, 2], [1]]
    assert fragment_pieces(0, 6, (4, 2), 3) == [[4], [2], []]


def test_more_fragments_than_tensors_is_refused():
    """The tiny GPT has 29 tensors (wte, wpe, 12 per layer x 2, ln_f's two, lm_head): 29 fragments resolve, 30 do
    not, in one line naming the value and the valid range."""
    resolve(load_config(None, TINY + ["strategy.diloco.fragments=29"]), 2)
    with pytest.raises(LayoutError) as err:
        resolve(load_config(None, TINY + ["strategy.diloco.fragments=30"]), 2)
    msg = str(err.value)
    assert "strategy.diloco.fragments = 30" in msg and "29 tensors" in msg and "1..29" in msg and "\n" not in msg
