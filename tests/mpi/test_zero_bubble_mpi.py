"""Zero-bubble pipeline schedules (zb1p, zbv) train exactly like one process (float64, rtol 1e-10) at the
layouts the pipeline suite runs: pp 1, 2 and 4; with data parallel, sharding stages 1-3, tensor parallel with
and without sequence parallelism; full and selective recompute, gradient merge, flash attention, a tied head;
the gpt, llama and mlp kinds. bfloat16 amp equals the one-process bfloat16 run within the amp tolerance of
test_combinations.py. A checkpoint saved under zbv loads under 1f1b and under one process, and back."""
import numpy as np
import pytest
from mpi4py import MPI

from helpers import LLAMA, assert_resumes_like, assert_same, assert_same_params, config, need, run
from hpengine.run.train import save_state

STEPS = 3
LAYERS = ["model.n_layers=8", "model.n_heads=4"]    # 8 blocks: 2 chunks per rank on 4 ranks
KINDS = {"gpt": [], "llama": LLAMA, "mlp": ["model.kind=mlp"]}
S = "strategy."


def pipeline(p, schedule, m=None):
    """pp p under `schedule`; zbv needs m >= 2p - 1 micro-batches, zb1p takes 4."""
    m = m or (8 if schedule == "zbv" and p > 2 else 4)
    return [S + "pipeline.enable=true", f"{S}pipeline.degree={p}", f"{S}pipeline.schedule={schedule}",
            f"{S}pipeline.micro_batches={m}", "train.global_batch=16"]


def on(switch, degree, *more):
    return [f"{S}{switch}.enable=true", f"{S}{switch}.degree={degree}", *more]


# name -> (world size, pipeline degree, kind, other overrides)
LAYOUTS = {
    "pp1": (1, 1, "gpt", []),
    "pp2": (2, 2, "gpt", []),
    "pp2_llama": (2, 2, "llama", []),
    "pp2_mlp": (2, 2, "mlp", []),
    "pp2_tied": (2, 2, "gpt", ["model.tie_head=true"]),
    "pp2_recompute": (2, 2, "gpt", [S + "recompute.enable=true"]),
    "pp2_selective": (2, 2, "llama", [S + "recompute.enable=true", S + "recompute.granularity=selective"]),
    "pp2_merge": (2, 2, "gpt", [S + "gradient_merge.enable=true", S + "gradient_merge.k_steps=2"]),
    "pp2_flash": (2, 2, "llama", ["model.attention=flash"]),
    "pp4": (4, 4, "gpt", []),
    "pp4_llama_tied": (4, 4, "llama", ["model.tie_head=true"]),
    "pp2_dp2": (4, 2, "gpt", on("data_parallel", 2)),
    "pp2_sh2_stage1": (4, 2, "gpt", on("sharding", 2, S + "sharding.stage=1")),
    "pp2_sh2_stage2": (4, 2, "llama", on("sharding", 2, S + "sharding.stage=2")),
    "pp2_sh2_stage3": (4, 2, "gpt", on("sharding", 2, S + "sharding.stage=3", "model.tie_head=true")),
    "pp2_tp2": (4, 2, "gpt", on("tensor_parallel", 2)),
    "pp2_tp2_sp": (4, 2, "llama", on("tensor_parallel", 2, S + "tensor_parallel.sequence_parallel=true")),
    "pp2_tp2_sp_mlp_recompute": (4, 2, "mlp", on("tensor_parallel", 2, S + "tensor_parallel.sequence_parallel=true",
                                                  S + "recompute.enable=true")),
}
_REF = {}


def reference(corpus, *extra):
    key = tuple(extra)
    if key not in _REF:
        _REF[key] = run(config(corpus, *LAYERS, "train.global_batch=16", *extra), MPI.COMM_SELF, STEPS)
    return _REF[key]


def model_only(extra):
    """The overrides that change the model (not the layout): what the one-process run takes."""
    return [o for o in extra if o.startswith("model.")]


@pytest.mark.parametrize("schedule", ["zb1p", "zbv"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero_bubble_equals_one_process(corpus, world, name, schedule):
    n, p, kind, extra = LAYOUTS[name]
    need(world.Get_size() == n, f"{name} runs at -n {n}")
    cfg = config(corpus, *LAYERS, *KINDS[kind], *pipeline(p, schedule), *extra)
    losses, params, eng = run(cfg, world, STEPS)
    ref_l, ref_p, ref = reference(corpus, *KINDS[kind], *model_only(extra))
    assert_same(losses, ref_l)
    assert_same(eng.grad_norms, ref.grad_norms)
    assert_same_params(params, ref_p)
    assert eng.pipe.split_bw


@pytest.mark.parametrize("schedule", ["zb1p", "zbv"])
def test_zero_bubble_bfloat16(corpus, world, schedule):
    need(world.Get_size() == 2, "pp 2 at -n 2")
    amp = ["model.dtype=float32", S + "amp.enable=true", S + "amp.dtype=bfloat16", S + "amp.grad_dtype=bfloat16"]
    losses, params, eng = run(config(corpus, *LAYERS, *pipeline(2, schedule), *amp), world, STEPS)
    ref_l, ref_p, ref = reference(corpus, *amp)
    # the same products; bfloat16 gradients round after each block's W instead of its whole backward, and
    # the layer norms' weight gradients of the next micro-batch may land first: a rounding apart, now and then
    np.testing.assert_allclose(losses, ref_l, rtol=1e-2)
    flat = lambda d: np.concatenate([np.ravel(d[k]) for k in sorted(ref_p)])  # noqa: E731
    init = run(config(corpus, *LAYERS, "train.global_batch=16", *amp), MPI.COMM_SELF, 0)[1]
    err = np.linalg.norm(flat(params) - flat(ref_p)) / np.linalg.norm(flat(ref_p) - flat(init))
    assert err < 5e-2, f"bfloat16 update differs by {err:.3%}"


@pytest.mark.parametrize("direction", ["from_zbv", "to_zbv"])
def test_zbv_checkpoint_loads_under_other_layouts(corpus, world, root, direction):
    need(world.Get_size() == 2, "zbv pp 2 at -n 2")
    zbv, other = pipeline(2, "zbv"), pipeline(2, "1f1b", m=2)
    a, b = (zbv, other) if direction == "from_zbv" else (other, zbv)
    _, _, eng_a = run(config(corpus, *LAYERS, *a), world, 2)
    save_state(eng_a, root, 2, keep=1)
    world.Barrier()
    straight = run(config(corpus, *LAYERS, "train.global_batch=16"), MPI.COMM_SELF, 4)
    for comm, lay in ((world, b), (MPI.COMM_SELF, ["train.global_batch=16"])):   # and one process
        assert_resumes_like(config(corpus, *LAYERS, *lay), comm, root, straight)
        world.Barrier()
