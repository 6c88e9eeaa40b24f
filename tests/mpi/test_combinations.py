"""Every combination of the seven switches, with parallel degrees that fit the world (a sample of 3-axis
meshes at -n 8), for the gpt and llama kinds, and a seeded sample of those with context parallel, expert
parallel (a mixture-of-experts llama), a zero-bubble schedule or the deepseek kind (latent attention through
flash), train like one process: float64 to rtol 1e-10; amp within AMP_LOSS_RTOL and AMP_UPDATE_RTOL of the
float32 (float16) or bfloat16 one-process run."""
import collections
import itertools
import os
import random
from dataclasses import dataclass

import numpy as np
import pytest
from mpi4py import MPI

from helpers import TINY, assert_same, assert_same_params, config, run
from hpengine.config.load import ConfigError, load_config
from hpengine.layout.resolve import PipelineError, TopologyError, resolve

N = MPI.COMM_WORLD.Get_size()
AXES = {"dp": "data_parallel", "sharding": "sharding", "pp": "pipeline", "tp": "tensor_parallel"}
BASE = ["model.n_heads=4", "model.n_layers=4", "train.global_batch=16"]
# grouped-query (2 query heads per key/value head) with 4 key/value heads, so tp up to 4 splits them
KINDS = {"gpt": [], "llama": ["model.kind=llama", "model.d_model=32", "model.n_heads=8", "model.n_kv_heads=4",
                              "model.ffn_hidden=48"]}
STEPS = 3
# amp tolerance against the float32 one-process run (float16 has an 11-bit significand, ~5e-4 relative):
# losses to 1e-2 relative; the parameter update of the whole model (after - before, all tensors) to 5%.
AMP_LOSS_RTOL, AMP_UPDATE_RTOL = 1e-2, 5e-2


def factorizations(n, k):
    """Ordered k-tuples of degrees >= 2 whose product is n."""
    if k == 0:
        return [()] if n == 1 else []
    return [(d,) + rest for d in range(2, n + 1) if n % d == 0 for rest in factorizations(n // d, k - 1)]


def meshes(n, names=AXES):
    out = []
    for k in range(len(names) + 1):
        for axes in itertools.combinations(names, k):
            out += [dict(zip(axes, degs)) for degs in factorizations(n, k)]
    return out


def combos(n):
    """(mesh, recompute, gradient_merge, amp) for every mesh; the toggles all 8 ways (a sample at n=8)."""
    cases = [(mesh, rc, gm, amp) for mesh in meshes(n) for rc, gm, amp in itertools.product([0, 1], repeat=3)]
    if n >= 8:
        cases = [c for i, c in enumerate(cases) if len(c[0]) >= 3 and i % 3 == 0]
    return cases


def bf16(i):
    """Which amp cases run bfloat16: every other pair of cases, so both dtypes meet every mesh."""
    return (i // 2) % 2 == 1


def overrides(mesh, rc, gm, amp, i):
    o = []
    for axis, deg in mesh.items():
        o += [f"strategy.{AXES[axis]}.enable=true", f"strategy.{AXES[axis]}.degree={deg}"]
    if "sharding" in mesh:
        o.append(f"strategy.sharding.stage={1 + i % 3}")
    if "pp" in mesh:
        p = mesh["pp"]
        sched = ["fthenb", "1f1b", "interleaved"][i % 3] if 2 * p <= 4 else ["fthenb", "1f1b"][i % 2]
        o += ["strategy.pipeline.micro_batches=2" if sched != "interleaved" else f"strategy.pipeline.micro_batches={p}",
              f"strategy.pipeline.schedule={sched}"]
        if sched == "interleaved":
            o.append("strategy.pipeline.virtual_stages=2")
    if "tp" in mesh and i % 2:      # sequence parallelism in every other tp case
        o.append("strategy.tensor_parallel.sequence_parallel=true")
    if rc:
        o += ["strategy.recompute.enable=true", "strategy.recompute.every=2"]
    if gm:
        o += ["strategy.gradient_merge.enable=true", "strategy.gradient_merge.k_steps=2"]
    if amp:             # float16 and bfloat16 (emulated, precision.py) take turns
        o += ["strategy.amp.enable=true", "model.dtype=float32"] + (["strategy.amp.dtype=bfloat16"] if bf16(i) else [])
    return o


_REF = {}


def reference(corpus, kind, dtype, steps=STEPS):
    """The one-process run in dtype; "bfloat16" is the one-process bfloat16 amp run."""
    if (kind, dtype, steps) not in _REF:
        prec = ([f"model.dtype={dtype}"] if dtype != "bfloat16" else
                ["model.dtype=float32", "strategy.amp.enable=true", "strategy.amp.dtype=bfloat16"])
        _REF[kind, dtype, steps] = run(config(corpus, *BASE, *MODELS[kind], *prec), MPI.COMM_SELF, steps)
    return _REF[kind, dtype, steps]


def assert_like_one_process(corpus, kind, amp, losses, params, eng):
    """STEPS steps of eng (amp: "", "float16" or "bfloat16") against the one-process run of the same model."""
    ref_dtype = amp if amp == "bfloat16" else "float32" if amp else "float64"
    ref_l, ref_p, ref_eng = reference(corpus, kind, ref_dtype)
    if amp:
        # float16 against the float32 run; bfloat16 against the one-process bfloat16 run, whose only
        # differences are float32 sums in another order, now and then rounding to the other bf16 neighbour
        np.testing.assert_allclose(losses, ref_l, rtol=AMP_LOSS_RTOL)
        # Adam normalises each gradient element, so tiny float16 differences in near-zero gradients move
        # single weights by up to ~lr: compare the whole update, not element by element
        init = reference(corpus, kind, ref_dtype, steps=0)[1]
        flat = lambda d: np.concatenate([np.ravel(d[n]) for n in sorted(ref_p)])  # noqa: E731
        upd_err = np.linalg.norm(flat(params) - flat(ref_p)) / np.linalg.norm(flat(ref_p) - flat(init))
        assert upd_err < AMP_UPDATE_RTOL, f"amp update differs from {ref_dtype} by {upd_err:.3%}"
        np.testing.assert_allclose(eng.grad_norms, ref_eng.grad_norms, rtol=AMP_LOSS_RTOL)
    else:
        assert_same(losses, ref_l)
        # global-norm clipping counts every parameter once, whatever the layout
        assert_same(eng.grad_norms, ref_eng.grad_norms)
        assert_same_params(params, ref_p)


CASES = combos(N)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[" ".join(f"{a}{d}" for a, d in c[0].items()) + f" rc{c[1]} gm{c[2]} amp{c[3]}"
                              for c in CASES])
def test_combination(corpus, world, case, kind):
    mesh, rc, gm, amp = CASES[case]
    losses, params, eng = run(config(corpus, *BASE, *KINDS[kind], *overrides(mesh, rc, gm, amp, case)), world, STEPS)
    assert_like_one_process(corpus, kind, ("bfloat16" if bf16(case) else "float16") if amp else "", losses, params, eng)


# The seeded sample. Beside the four axes above: cp (a fifth mesh axis), ep (inside dp, for the moe kind),
# and the zero-bubble schedules zb1p and zbv beside fthenb, 1f1b and interleaved. The engine accepts 944 such
# cases at -n 4 and 2616 at -n 8, about a second each at -n 4 on 2 cores: SAMPLE_SIZE of them run.
# HPENGINE_COMBO_SEED draws another sample, HPENGINE_COMBO_SAMPLE another size ("all": every case).
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=12", "model.moe.shared_hidden=8",
       "model.moe.dense_layers=1", "model.moe.aux_loss=0.01", "model.moe.z_loss=0.001"]
# multi-head latent attention with values narrower than the queries and keys and a query bottleneck, through flash
# attention (context parallelism runs its own drivers); tp up to 4 splits its heads and SwiGLU width
DEEPSEEK = ["model.kind=deepseek", "model.ffn_hidden=24", "model.mla.q_lora_rank=6", "model.mla.kv_lora_rank=6",
            "model.mla.qk_nope_head_dim=4", "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=2",
            "model.attention=flash"]
MODELS = {**KINDS, "moe": KINDS["llama"] + MOE, "deepseek": DEEPSEEK}
MESH_AXES = {**AXES, "cp": "context_parallel"}
SCHEDULES = ("fthenb", "1f1b", "interleaved", "zb1p", "zbv")
# what the enumeration above lacks; a sampled case has one or more, and they take turns in the sample
NEW = ("cp", "ep", "zb1p", "zbv", "moe", "deepseek")
SAMPLE_SIZE = {1: 8, 2: 32, 4: 64, 8: 32}     # 8 is every case at -n 1


def micro_batches(schedule, p):
    """interleaved: p (a multiple of the degree); zbv: at least 2p - 1, rounded up to a power of 2 so that it
    divides the batch; the others 2."""
    return p if schedule == "interleaved" else 1 << (2 * p - 2).bit_length() if schedule == "zbv" else 2


@dataclass(frozen=True)
class Case:
    """One layout: the model kind, the mesh (axis -> degree), ep inside dp, the schedule, the toggles, and the
    choices drawn beside them (sharding stage, sequence parallel, cp's ring or all-gather, the amp dtype)."""
    kind: str
    mesh: tuple             # ((axis, degree), ...) in MESH_AXES order
    ep: int
    schedule: str           # "" without pp
    rc: int
    gm: int
    amp: str                # "", "float16" or "bfloat16"
    stage: int
    sp: bool
    cp_comm: str

    @property
    def features(self) -> set:
        return ({"cp"} & set(dict(self.mesh)) | ({"ep"} if self.ep > 1 else set())
                | ({self.schedule} & {"zb1p", "zbv"}) | ({self.kind} & {"moe", "deepseek"}))

    def overrides(self) -> list:
        o = []
        for axis, deg in self.mesh:
            o += [f"strategy.{MESH_AXES[axis]}.enable=true", f"strategy.{MESH_AXES[axis]}.degree={deg}"]
        mesh = dict(self.mesh)
        if self.ep > 1:
            o += ["strategy.expert_parallel.enable=true", f"strategy.expert_parallel.degree={self.ep}"]
        if self.stage:
            o.append(f"strategy.sharding.stage={self.stage}")
        if self.schedule:
            o += [f"strategy.pipeline.schedule={self.schedule}",
                  f"strategy.pipeline.micro_batches={micro_batches(self.schedule, mesh['pp'])}"]
            o += ["strategy.pipeline.virtual_stages=2"] if self.schedule == "interleaved" else []
        o += ["strategy.tensor_parallel.sequence_parallel=true"] if self.sp else []
        o += [f"strategy.context_parallel.comm={self.cp_comm}"] if self.cp_comm else []
        o += ["strategy.recompute.enable=true", "strategy.recompute.every=2"] if self.rc else []
        o += ["strategy.gradient_merge.enable=true", "strategy.gradient_merge.k_steps=2"] if self.gm else []
        if self.amp:
            o += ["strategy.amp.enable=true", "model.dtype=float32", f"strategy.amp.dtype={self.amp}"]
        return o

    @property
    def name(self) -> str:
        """The whole layout, e.g. "moe dp2 ep2 pp2-zbv-m4 cp2-ring rc1 gm0 amp-bfloat16"."""
        words = [self.kind]
        for axis, deg in self.mesh:
            words.append({"dp": f"dp{deg}" + (f" ep{self.ep}" if self.ep > 1 else ""),
                          "sharding": f"sh{deg}-stage{self.stage}" + (f" ep{self.ep}" if self.ep > 1 and
                                                                      "dp" not in dict(self.mesh) else ""),
                          "pp": f"pp{deg}-{self.schedule}-m{micro_batches(self.schedule, deg)}",
                          "tp": f"tp{deg}" + ("-sp" if self.sp else ""), "cp": f"cp{deg}-{self.cp_comm}"}[axis])
        return " ".join(words + [f"rc{self.rc}", f"gm{self.gm}", f"amp-{self.amp}" if self.amp else "amp0"])


def candidates(n, rng):
    """Every kind x mesh of the five axes x ep (the moe kind: the divisors of dp x sharding and of its 4 experts)
    x schedule x toggles that has one of NEW; the choices beside them drawn from rng."""
    for kind, mesh in itertools.product(MODELS, meshes(n, MESH_AXES)):
        eps = [e for e in (1, 2, 4) if mesh.get("dp", 1) * mesh.get("sharding", 1) % e == 0 and (e == 1 or kind == "moe")]
        for ep, sched, rc, gm, amp in itertools.product(eps, SCHEDULES if "pp" in mesh else [""], *[(0, 1)] * 3):
            # bfloat16 is judged against the one-process bfloat16 run, which differs only in the order of float32
            # sums; under cp attention runs block by block (online softmax), rounding other bfloat16 products
            # than one process does, so cp draws float16 (judged against the float32 run)
            dtype = rng.choice(["float16", "bfloat16"]) if "cp" not in mesh else "float16"
            case = Case(kind, tuple(mesh.items()), ep, sched, rc, gm, dtype if amp else "",
                        rng.choice([1, 2, 3]) if "sharding" in mesh else 0, "tp" in mesh and rng.random() < 0.5,
                        rng.choice(["ring", "allgather"]) if "cp" in mesh else "")
            if case.features:
                yield case


def accepted(case, n) -> bool:
    """Whether the engine takes the case on n ranks: its own validation (pure, the same answer on every rank)."""
    try:
        resolve(load_config(None, [*TINY, *BASE, *MODELS[case.kind], *case.overrides()]), n)
    except (ConfigError, TopologyError, PipelineError):
        return False
    return True


def by_mesh(cases):
    """cases with the meshes (ep included) taking turns: the first case of each mesh, then the second, ...; so
    that the five schedules do not make the pipeline meshes five times as likely."""
    seen, turn = collections.Counter(), []
    for c in cases:
        turn.append(seen[c.mesh, c.ep])
        seen[c.mesh, c.ep] += 1
    return [c for _, c in sorted(zip(turn, cases), key=lambda t: t[0])]


def sample(n, seed, size):
    """`size` accepted cases (every one when size is None) drawn with random.Random(seed): NEW's features take
    turns, each taking the next case that has it in a shuffled order (by_mesh), so each appears about equally
    often."""
    rng = random.Random(seed)
    pool = list(candidates(n, rng))
    rng.shuffle(pool)
    if size is None:
        return [c for c in pool if accepted(c, n)]
    queues = {f: iter(by_mesh([c for c in pool if f in c.features])) for f in NEW}
    picked = []
    while queues and len(picked) < size:
        for f in list(queues):
            case = next((c for c in queues[f] if c not in picked and accepted(c, n)), None)
            if case is None:
                del queues[f]
            elif len(picked) < size:
                picked.append(case)
    return picked


def _knob(name, default, world=MPI.COMM_WORLD):
    """An environment variable as rank 0 reads it, so every rank draws the same sample."""
    return world.bcast(os.environ.get(name, default) if world.Get_rank() == 0 else None, root=0)


SEED = int(_knob("HPENGINE_COMBO_SEED", "0"))
_size = _knob("HPENGINE_COMBO_SAMPLE", str(SAMPLE_SIZE.get(N, 12)))
SAMPLED = sample(N, SEED, None if _size == "all" else int(_size))
SAMPLE_NOTE = (f"test_combinations.py: {len(SAMPLED)} sampled cases with {', '.join(NEW)} at -n {N}, seed {SEED} "
               f"(HPENGINE_COMBO_SEED={SEED} HPENGINE_COMBO_SAMPLE={_size} draws them again)")


@pytest.mark.parametrize("case", SAMPLED, ids=[c.name for c in SAMPLED])
def test_sampled_combination(corpus, world, case):
    losses, params, eng = run(config(corpus, *BASE, *MODELS[case.kind], *case.overrides()), world, STEPS)
    mesh = dict(case.mesh)
    assert eng.res.degrees.by_axis == {a: mesh.get(a, 1) for a in ("tp", "cp", "sharding", "dp", "pp")}
    assert (eng.res.ep, eng.res.schedule if case.schedule else "") == (case.ep, case.schedule)
    assert_like_one_process(corpus, case.kind, case.amp, losses, params, eng)
