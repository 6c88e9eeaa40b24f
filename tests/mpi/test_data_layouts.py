"""Blends of token files and a separate validation file give every layout the batches of the one-process
run: training and evaluation under dp x sharding (and tp) equal one process (float64, rtol 1e-10)."""
import os
import shutil
import tempfile

import pytest
from mpi4py import MPI

from helpers import assert_same, assert_same_params, config, need, run

WORLD = MPI.COMM_WORLD


@pytest.fixture(scope="module")
def blend(corpus):
    """Two more token files every rank sees: a second source and a validation file."""
    from hpengine.data import build_corpus
    paths = None
    if WORLD.Get_rank() == 0:
        d = tempfile.mkdtemp(prefix="hpengine-blend-")
        for name, text in (("b", b"def g(y):\n    return y + 1\n" * 40), ("val", b"The lazy dog sleeps. " * 60)):
            for i in range(2):
                with open(os.path.join(d, f"{name}{i}.txt"), "wb") as f:
                    f.write(text[i:])
        paths = {n: build_corpus([os.path.join(d, f"{n}{i}.txt") for i in range(2)], os.path.join(d, f"{n}.h5"))["path"]
                 for n in ("b", "val")}
    paths = WORLD.bcast(paths, root=0)
    yield paths
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(os.path.dirname(paths["b"]), ignore_errors=True)


def data_overrides(corpus, blend):
    return ["data.path=", f'data.sources=[{{path="{corpus}", weight=1.0}}, {{path="{blend["b"]}", weight=3.0}}]',
            f"data.val_path={blend['val']}", "train.eval_batches=2"]


@pytest.mark.parametrize("layout", ["dp", "tp_sharding"])
def test_blend_and_val_file_equal_one_process(corpus, blend, world, layout):
    n = world.Get_size()
    need(n in (2, 4), "needs 2 or 4 ranks")
    if layout == "dp":
        strat = ["strategy.data_parallel.enable=true", f"strategy.data_parallel.degree={n}"]
    else:
        strat = ["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2",
                 "strategy.sharding.enable=true", "strategy.sharding.stage=2", "strategy.sharding.degree=-1"]
    extra = data_overrides(corpus, blend)
    losses, params, eng = run(config(corpus, *extra, *strat), world, steps=3)
    ref_l, ref_p, ref = run(config(corpus, *extra), MPI.COMM_SELF, steps=3)
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p)
    assert_same(eng.evaluate(), ref.evaluate())
    # the blend really draws from both files: rows of step 0 come from each source
    sources, _ = eng.data.rows("train", 0, eng.cfg.train.seed, eng.cfg.train.global_batch)
    assert set(sources.tolist()) == {0, 1}
