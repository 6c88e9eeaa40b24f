"""The owners of whole-tensor work (Muon's Newton-Schulz): a hand-computed assignment, and the balance on the
reference GPT and the Muon llama at 4 owners (the busiest owner holds at most 0.3 of the work)."""
import pytest

from hpengine.config.load import load_config
from hpengine.models import build_model
from hpengine.optim import optimizer_kind
from hpengine.params.buffers import assign_owners, load_imbalance


def test_the_heaviest_goes_first_to_the_least_loaded_owner():
    # 8 -> 0; 7 -> 1; 6 -> 1 (7 < 8); 5 -> 0 (8 < 13); 4 -> 0 (13 = 13: the lower index): loads 17 and 13
    assert assign_owners([8, 7, 6, 5, 4], 2) == [0, 1, 1, 0, 0]
    assert assign_owners([4, 5, 6, 7, 8], 2) == [0, 0, 1, 1, 0]        # the same owners whatever the order
    assert assign_owners([3, 3], 4) == [0, 1]
    assert load_imbalance([17, 13]) == pytest.approx(17 / 15)


@pytest.mark.parametrize("path", ["configs/default.toml", "configs/muon.toml"])
def test_four_owners_share_the_newton_schulz_work_within_1_2(path):
    mc = load_config(path, ["optim.name=muon"]).model
    work = optimizer_kind("muon").work
    w = [x for x in (work(s, s.global_shape) for s in build_model(mc).all_specs()) if x]
    owners = assign_owners(w, 4)
    loads = [sum(x for x, o in zip(w, owners) if o == k) for k in range(4)]
    assert max(loads) <= 0.3 * sum(w)
    assert load_imbalance(loads) <= 1.2
