"""The planner's sequence parallelism against Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", section 4.2.2): with tensor and sequence parallelism of degree t, every part of a
layer's activations is split t ways, so a layer caches exactly 1/t of what it caches on one rank; without
sequence parallelism the norms and the linear inputs stay whole on every rank. The bytes by hand, term by
term, for one small GPT; the ratios for every model kind. Layouts: the config's
switch reaches the resolved layout and the planner's search."""
import pytest

from hpengine.config.load import load_config
from hpengine.models import build_model
from hpengine.planner.search import Cluster, candidates, config_for
from hpengine.planner.tp import activation_calls
from hpengine.planner.memory import block_activations
from hpengine.planner.stages import stages
from hpengine.layout.resolve import LayoutError, resolve

MODEL = ["model.d_model=64", "model.n_heads=8", "model.seq_len=32", "model.n_layers=2", "model.vocab_size=256"]
KINDS = {"gpt": [], "gpt_flash": ["model.attention=flash"], "mlp": ["model.kind=mlp"],
         "llama": ["model.kind=llama", "model.n_kv_heads=4", "model.ffn_hidden=96"],
         "llama_flash": ["model.kind=llama", "model.n_kv_heads=4", "model.ffn_hidden=96", "model.attention=flash"]}


def test_gpt_activation_bytes_by_hand():
    """Korthikanti et al.'s per-layer accounting, term by term for this engine's caches (no dropout masks),
    for one small GPT: d_model C = 64, 8 heads (head dim 16), T = 32, 3 sequences per micro-batch (n = 96
    tokens), ffn 4C = 256, vocab 256, amp (2-byte activations), tensor parallelism t = 2 (4 local heads).
    A layer caches, in elements (ns = n / t tokens under sequence parallelism, n without):

      term                                    one rank       tp 2           tp 2 + sp
      ln1: xhat + rstd, ns C + ns             96*64+96=6240  6240           48*64+48=3120
      qkv's input (ln1's output), ns C        6144           6144           3072
      attention: qkv, scaled q, y, 5 n C / t  30720          15360          15360
        probabilities, rows * H/t * 768       3*8*768=18432  3*4*768=9216   9216
        (causal, two query blocks of 16: 16*16 + 16*32 = 768 per sequence and head)
      ln2, ns C + ns                          6240           6240           3120
      fc's input (ln2's output), ns C         6144           6144           3072
      GELU: input + sigmoid, 2 n 4C / t       49152          24576          24576
      sum                                     123072         73920          61536
      bytes (x 2)                             246144         147840         123072

    Sequence parallelism splits the norms and the linear inputs t ways too: 246144 / 2 = 123072. The
    probabilities alone ("scores", what selective recompute drops): 36864, 18432, 18432 bytes; a recomputed
    layer's input, ns C * 2: 12288, 12288, 6144. The head: final norm (ns C + ns) * 2 + its linear's
    input ns C * 2 + the loss's float32 probabilities n * 256/t * 4 + targets (one rank: 3 * 32 int64 = 768;
    under tp its own int64 index and bool mask, 96 * 9 = 864): 12480 + 12288 + 98304 + 768 = 123840;
    12480 + 12288 + 49152 + 864 = 74784; 6240 + 6144 + 49152 + 864 = 62400. The embedding keeps 96 * 9 =
    864 bytes of indices and masks in each case.

    The W stash of a split backward (zero-bubble schedules), what each block's deferred weight-gradient
    work holds from B to W. A layer: the two row linears' whole output gradients (n C each: gathered under
    sequence parallelism) and inputs (the GELU's output n 4C / t, the attention's output n C / t), the two
    column linears' output gradients (n 4C / t, n 3C / t) and inputs (ns C each: this rank's piece under sp):
    one rank 96 * (128 + 128 + 768) * 2 = 196608; tp 96 * (128 + 128 + 384) * 2 = 122880; sp 96 * (128 + 64
    + 384) * 2 = 110592. The head: the logits' gradient n * 256 / t and the linear's input ns C: 61440,
    36864, 30720. The embedding: its input gradient ns C and the 864 bytes of indices: 13152, 13152, 7008.

    What packed bf16 storage keeps as bfloat16 bits, in elements: the head's linear input and its norm's
    normalised input, ns C each, in its cache (12288, 12288, 6144), the linear input in its W stash (6144, 6144,
    3072); a layer's W stash the two column linears'
    inputs ns C each, the GELU's output and its gradient n 4C / t each and the attention's output n C / t:
    96 * (128 + 256 + 256 + 64) = 67584, 96 * (128 + 128 + 128 + 32) = 39936, 96 * (64 + 128 + 128 + 32) = 33792."""
    base = MODEL + ["train.global_batch=3", "strategy.amp.enable=true"]
    tp = ["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2"]
    want = {"one": dict(layer=246144, scores=36864, input=12288, head=123840, embed=864,
                        w_layer=196608, w_head=61440, w_embed=13152, bits_head=12288, bits_w_head=6144,
                        bits_w_layer=67584),
            "tp": dict(layer=147840, scores=18432, input=12288, head=74784, embed=864,
                       w_layer=122880, w_head=36864, w_embed=13152, bits_head=12288, bits_w_head=6144,
                       bits_w_layer=39936),
            "sp": dict(layer=123072, scores=18432, input=6144, head=62400, embed=864,
                       w_layer=110592, w_head=30720, w_embed=7008, bits_head=6144, bits_w_head=3072,
                       bits_w_layer=33792)}
    for name, extra, world in (("one", [], 1), ("tp", tp, 2),
                               ("sp", tp + ["strategy.tensor_parallel.sequence_parallel=true"], 2)):
        cfg = load_config(None, base + extra)
        lay = resolve(cfg, world)
        assert (lay.tp, lay.sp, lay.rows) == (world, name == "sp", 3)
        assert block_activations(cfg.model, lay, 2) == want[name], name


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("item", [2, 4])
def test_layer_activations_split_t_ways(kind, t, item):
    mcfg = load_config(None, MODEL + KINDS[kind]).model
    rows = 3
    one = build_model(mcfg, 1).cache_bytes(rows, 1, item, item == 2, rows)
    sp = build_model(mcfg, t).cache_bytes(rows, t, item, item == 2, rows, parts=t)
    tp = build_model(mcfg, t).cache_bytes(rows, t, item, item == 2, rows)
    assert sp["layer"] * t == one["layer"]
    assert sp["input"] * t == one["input"]
    assert sp["scores"] * t == one["scores"]
    # plain tp keeps the norms' caches and the two linear inputs whole: more than 1/t, less than one rank
    assert one["layer"] > tp["layer"] > sp["layer"]


def test_sequence_parallel_calls_by_hand():
    """Per micro-batch through a whole 2-layer GPT: plain tp 2 allreduces forward + 2 backward per layer,
    1 for the embedding, 1 for the head; sequence parallel 3 x 2 all-gathers and 2 x 2 reduce-scatters per
    layer, the embedding 1 + 1, the head 2 + 1 (the same count tests/mpi measures on the engine)."""
    mcfg = load_config(None, MODEL).model
    st = stages(mcfg, 2, 1, 1)[0]
    plain = resolve(load_config(None, MODEL + ["strategy.tensor_parallel.enable=true"]), 2)
    sp = resolve(load_config(None, MODEL + ["strategy.tensor_parallel.enable=true",
                                            "strategy.tensor_parallel.sequence_parallel=true"]), 2)
    assert activation_calls(mcfg, st, plain) == {"allreduce": 4 * 2 + 2}
    assert activation_calls(mcfg, st, sp) == {"allgather": 6 * 2 + 3, "reduce_scatter": 4 * 2 + 2}


def test_seq_len_must_divide():
    cfg = load_config(None, MODEL + ["model.seq_len=30", "strategy.tensor_parallel.enable=true",
                                     "strategy.tensor_parallel.sequence_parallel=true"])
    with pytest.raises(LayoutError, match=r"model.seq_len = 30 divisible by tensor_parallel.degree = 4"):
        resolve(cfg, 4)


def test_one_rank_leaves_it_off():
    cfg = load_config(None, MODEL + ["strategy.tensor_parallel.sequence_parallel=true"])
    assert not resolve(cfg, 1).sp


def test_search_offers_sequence_parallel_and_selective_and_writes_them():
    cfg = load_config(None, MODEL + ["train.global_batch=8"])
    lays = list(candidates(cfg, Cluster(nodes=1, gpus_per_node=4)))
    assert any(l.sp for l in lays) and any(l.granularity == "selective" and l.recompute for l in lays)
    assert not any(l.sp for l in lays if l.tp == 1)
    for lay in [l for l in lays if l.sp or l.scatter][:20]:
        assert resolve(config_for(cfg, lay), lay.world) == lay
