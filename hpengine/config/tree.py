"""The configuration tree: one dataclass per TOML section, every field with a default, a one-line doc
(``metadata["doc"]``) and its check; the [model] keys of one model kind (``metadata["kinds"]``). Loading,
validation and output live in load.py, which re-exports everything here.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any

MESH_AXES = ("tp", "cp", "sharding", "dp", "pp")


def mesh_order(order) -> tuple:
    """mesh.order as a permutation of every axis: an order naming the four axes without cp (as configs written
    before context parallelism do) gets cp right after tp."""
    order = tuple(order)
    if "cp" in order or "tp" not in order:
        return order
    i = order.index("tp") + 1
    return order[:i] + ("cp",) + order[i:]


class ConfigError(Exception):
    """A config that cannot run; the one-line message names the key, the value and what is valid."""


# ---- field helpers: a check is (predicate, what a valid value is) ---------------------------------

def _f(default: Any, doc: str, *, choices: tuple | None = None, check: tuple | None = None,
       kinds: tuple | None = None, key: str | None = None):
    meta: dict[str, Any] = {"doc": doc}
    if key is not None:          # the TOML key, where the field's name stands in for a Python keyword
        meta["key"] = key
    if kinds is not None:        # a [model] key that applies only to these model kinds
        meta["kinds"] = kinds
    if choices is not None:
        meta["choices"] = choices
    if check is not None:
        meta["check"] = check
    if isinstance(default, list):
        return field(default_factory=lambda d=tuple(default): list(d), metadata=meta)
    return field(default=default, metadata=meta)


_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


def _must(*bounds):
    """A check from (op, limit) pairs: ``_must(">", 0, "<", 1)`` -> "must be > 0 and < 1"."""
    pairs = list(zip(bounds[::2], bounds[1::2]))
    return (lambda v: all(_OPS[op](v, lim) for op, lim in pairs),
            "must be " + " and ".join(f"{op} {lim}" for op, lim in pairs))


_POS = _must(">=", 1)
_DEGREE = (lambda v: v == -1 or v >= 1, "must be -1 (the ranks left over) or >= 1")
_BETAS = (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
          "must be a list of exactly two numbers, each >= 0 and < 1")
_THREE = (lambda v: len(v) == 3, "must be a list of exactly three numbers")
_SPLIT = (lambda v: v in ("uniform", "params") if isinstance(v, str) else len(v) > 0 and min(v) >= 1,
          'must be "uniform", "params" or a non-empty list of blocks per stage, each >= 1')
_ORDER = (lambda v: sorted(mesh_order(v)) == sorted(MESH_AXES),
          'must be a permutation of ["tp", "cp", "sharding", "dp", "pp"] (without "cp", it goes right after "tp")')
_RATES = {"bit/s": 1 / 8, "kbit/s": 1e3 / 8, "mbit/s": 1e6 / 8, "gbit/s": 1e9 / 8, "b/s": 1.0, "kb/s": 1e3,
          "mb/s": 1e6, "gb/s": 1e9}
_TIMES = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def _quantity(text: str, units: dict) -> float:
    text = text.strip().lower()
    for u in sorted(units, key=len, reverse=True):
        if text.endswith(u):
            value = float(text[:-len(u)])
            if value < 0 or value != value or value == float("inf"):
                raise ValueError(text)
            return value * units[u]
    raise ValueError(text)


def parse_link(text: str) -> tuple[float, float]:
    """runtime.replica_link as (bytes per second, latency in seconds); ValueError when malformed."""
    bw, lat = text.split(",")
    rate = _quantity(bw, _RATES)
    if rate <= 0:
        raise ValueError(text)
    return rate, _quantity(lat, _TIMES)


def _link_ok(text) -> bool:
    try:
        parse_link(text)
        return True
    except ValueError:
        return False


_DEGREE_DOC = "ranks on this axis; -1 = the ranks left over"


# ---- the tree -------------------------------------------------------------------------------------

_LLAMA, _NOT_LLAMA, _DEEPSEEK = ("llama",), ("gpt", "mlp"), ("deepseek",)
_ROPE = _LLAMA + _DEEPSEEK          # the kinds with rotary embedding, RMSNorm and SwiGLU MLPs


@dataclass
class MoEConfig:
    """Mixture of experts for the llama and deepseek kinds: routed SwiGLU experts in place of the MLP (Mixtral,
    Qwen3-MoE, DeepSeek-V3).
    Every layer after the first `dense_layers` routes each token to its top_k experts, dropless unless
    capacity_factor caps what an expert takes."""
    num_experts: int = _f(0, "routed experts per MoE layer; 0 = a dense model", check=_must(">=", 0))
    top_k: int = _f(2, "experts each token is routed to", check=_POS)
    expert_hidden: int = _f(0, "SwiGLU width of each expert; 0 = the dense width (model.ffn_hidden or Llama's rule)",
                            check=_must(">=", 0))
    shared_hidden: int = _f(0, "SwiGLU width of an always-on shared expert beside the routed ones (Qwen2-MoE, "
                            "DeepSeek); 0 = none", check=_must(">=", 0))
    dense_layers: int = _f(0, "the first this many layers keep the dense MLP (DeepSeek's first_k_dense_replace)",
                           check=_must(">=", 0))
    router: str = _f("softmax", "router scores: softmax over the experts (Mixtral, Qwen3-MoE) or a sigmoid per "
                     "expert (DeepSeek-V3); top_k of them are chosen, ties to the lower expert index",
                     choices=("softmax", "sigmoid"))
    norm_topk: bool = _f(True, "divide each token's top_k gates by their sum")
    aux_loss: float = _f(0.0, "coefficient of the load-balancing loss E x sum_i f_i P_i, computed per sequence and "
                         "averaged over the global batch (the same whatever the layout); 0 = off",
                         check=_must(">=", 0))
    z_loss: float = _f(0.0, "coefficient of the router z-loss, the mean over tokens of logsumexp(logits)^2; 0 = off",
                       check=_must(">=", 0))
    capacity_factor: float = _f(0.0, "training passes: each expert takes at most ceil(capacity_factor x seq_len x "
                                "top_k / num_experts) (token, slot) assignments per sequence, the first by token "
                                "position, then the slot's rank in the token's top_k; the rest are dropped (gate 0 "
                                "after the top-k renormalisation, never sent to an expert); evaluation and decoding "
                                "stay dropless; 0 = dropless", check=_must(">=", 0))
    bias_update_rate: float = _f(0.0, "aux-loss-free balancing (DeepSeek-V3): a per-layer, per-expert bias added to "
                                 "the router scores for the top-k selection only; after every optimizer step "
                                 "bias += rate x sign(mean load - load) over the global batch's selections; kept in "
                                 "checkpoints; 0 = no bias", check=_must(">=", 0))
    n_groups: int = _f(1, "group-limited routing (DeepSeek-V3 n_group): the experts form this many equal groups of "
                       "consecutive indices; must divide num_experts; 1 = no groups", check=_POS)
    topk_groups: int = _f(1, "group-limited routing (DeepSeek-V3 topk_group): a token picks its top_k experts only "
                          "within its this many best groups, a group scoring the sum of its two largest selection "
                          "scores (router score + bias), ties to the lower group; 1..n_groups", check=_POS)
    routed_scaling: float = _f(1.0, "multiplies the routed experts' combined output, after the top-k "
                               "renormalisation (DeepSeek-V3 routed_scaling_factor); the shared expert is not "
                               "scaled", check=_must(">", 0))


@dataclass
class MLAConfig:
    """Multi-head latent attention of the deepseek kind (DeepSeek-V3, Kimi K2): queries through an optional
    low-rank bottleneck, per-head keys and values expanded from one compressed latent, one shared rotary key."""
    q_lora_rank: int = _f(0, "query bottleneck width (q_a, its RMSNorm, q_b); 0 = one d_model x n_heads*(nope + rope) "
                          "query matrix", check=_must(">=", 0))
    kv_lora_rank: int = _f(512, "width of the compressed latent the keys and values are expanded from (what "
                           "decoding caches per token, with the rotary key)", check=_POS)
    qk_nope_head_dim: int = _f(128, "per-head query/key width without rotation", check=_POS)
    qk_rope_head_dim: int = _f(64, "rotary width of every query head and of the one key all heads share (even)",
                               check=_must(">=", 2))
    v_head_dim: int = _f(128, "per-head value width", check=_POS)


@dataclass
class RopeScalingConfig:
    """Rotary embedding scaling of the deepseek kind (YaRN, Peng et al. 2023, as Hugging Face computes it)."""
    type: str = _f("none", "none: the plain rotary frequencies; yarn: frequencies between the beta_fast and "
                   "beta_slow correction dimensions ramped to 1 / factor, tables and softmax scaled by mscale",
                   choices=("none", "yarn"))
    factor: float = _f(1.0, "yarn: context extension factor (frequencies past the ramp divided by it)",
                       check=_must(">=", 1))
    original_max_position_embeddings: int = _f(4096, "yarn: the pretraining context length the ramp is measured "
                                               "against", check=_POS)
    beta_fast: float = _f(32.0, "yarn: rotations over the original length below which a pair is fully scaled",
                          check=_must(">", 0))
    beta_slow: float = _f(1.0, "yarn: rotations over the original length above which a pair keeps its frequency",
                          check=_must(">", 0))
    mscale: float = _f(0.0, "yarn: attention temperature of the tables, 0.1 x mscale x ln(factor) + 1 (0 = unset)",
                       check=_must(">=", 0))
    mscale_all_dim: float = _f(0.0, "yarn: the temperature the tables are divided by and whose square multiplies "
                               "the softmax scale (0 = unset)", check=_must(">=", 0))


@dataclass
class MTPConfig:
    """Multi-token prediction (DeepSeek-V3 section 2.2) for the llama family: `depth` sequential modules after the
    main model, module k predicting the token k + 1 places after the next from the previous depth's hidden state
    and the embedding of the token k places ahead, through the model's shared embedding and output head."""
    depth: int = _f(0, "MTP modules (each an RMSNorm pair, a 2 d_model -> d_model projection, one block of the "
                    "model's kind and a final RMSNorm); 0 = off, the model unchanged", check=_must(">=", 0))
    loss_weight: float = _f(0.3, "the MTP loss, the mean over the depths of each depth's cross-entropy over its "
                            "counted targets, times this joins the training loss (DeepSeek-V3's lambda)",
                            check=_must(">=", 0))


@dataclass
class ModelConfig:
    """The network and its numerics."""
    kind: str = _f("gpt", "model family: a GPT-2 style decoder, a Llama-family decoder (RMSNorm, SwiGLU, rotary "
                   "embedding, grouped-query attention), a DeepSeek-V3 / Kimi K2 decoder (multi-head latent attention, "
                   "routed experts) or a plain MLP", choices=("gpt", "llama", "deepseek", "mlp"))
    vocab_size: int = _f(256, "token vocabulary size (256 = raw bytes)", check=_POS)
    seq_len: int = _f(128, "tokens per training sequence (context length)", check=_POS)
    d_model: int = _f(256, "hidden width", check=_POS)
    n_layers: int = _f(4, "number of blocks (the units pipeline stages are cut from)", check=_POS)
    n_heads: int = _f(4, "attention (query) heads (gpt, llama); d_model must be a multiple of it unless "
                      "model.head_dim is set", check=_POS)
    n_kv_heads: int = _f(0, "llama: key/value heads, grouped-query attention; must divide n_heads; 0 = n_heads "
                         "(multi-head), 1 = multi-query", check=_must(">=", 0), kinds=_LLAMA)
    head_dim: int = _f(0, "llama: width of every query and key/value head (even, for the rotary pairs): q is "
                       "d_model x n_heads*head_dim, k and v d_model x n_kv_heads*head_dim, o n_heads*head_dim x "
                       "d_model; 0 = d_model / n_heads (Qwen3 uses 128 at every width)", check=_must(">=", 0),
                       kinds=_LLAMA)
    ffn_mult: int = _f(4, "gpt, mlp: feed-forward width as a multiple of d_model", check=_POS, kinds=_NOT_LLAMA)
    ffn_hidden: int = _f(0, "llama, deepseek: SwiGLU hidden width; 0 = Llama's rule, 8/3 x d_model rounded up to "
                         "ffn_multiple_of", check=_must(">=", 0), kinds=_ROPE)
    ffn_multiple_of: int = _f(256, "llama, deepseek: the multiple Llama's rule rounds the SwiGLU width up to", check=_POS,
                              kinds=_ROPE)
    rope_theta: float = _f(10000.0, "llama, deepseek: rotary embedding base (angle of pair i at position t: "
                           "t x rope_theta^(-2i/head_dim))", check=_must(">", 0), kinds=_ROPE)
    norm_eps: float = _f(1e-5, "llama, deepseek: RMSNorm epsilon", check=_must(">", 0), kinds=_ROPE)
    qk_norm: bool = _f(False, "llama: RMSNorm over head_dim of every head's q and k before the rotary embedding, "
                       "learned (head_dim,) weights h.{i}.attn.q_norm.w, k_norm.w with eps norm_eps (Qwen3)",
                       kinds=_LLAMA)
    attention: str = _f("standard", "gpt, llama, deepseek: causal attention; standard keeps every head's T x T "
                        "probabilities for backward, flash (fused, tiled, online softmax) keeps only the output "
                        "and one log-sum-exp per row and recomputes the scores in backward",
                        choices=("standard", "flash"), kinds=("gpt", "llama", "deepseek"))
    tie_head: bool = _f(False, "share the output head's weights with the token embedding")
    dtype: str = _f("float32", "parameter and compute dtype (float64 for exactness checks)",
                    choices=("float32", "float64"))
    init_std: float = _f(0.02, "standard deviation of the normal weight initialisation", check=_must(">", 0))
    moe: MoEConfig = field(default_factory=MoEConfig, metadata={"doc": "mixture of experts", "kinds": _ROPE})
    mtp: MTPConfig = field(default_factory=MTPConfig, metadata={"doc": "multi-token prediction", "kinds": _ROPE})
    mla: MLAConfig = field(default_factory=MLAConfig, metadata={"doc": "multi-head latent attention",
                                                                "kinds": _DEEPSEEK})
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig,
                                            metadata={"doc": "rotary embedding scaling", "kinds": _DEEPSEEK})


# the tables inside [model]
_SECTIONS = {"moe": MoEConfig, "mtp": MTPConfig, "mla": MLAConfig, "rope_scaling": RopeScalingConfig}


# field names of [model] and of each table inside it (model_key runs often in the planner's search: no astuple)
_MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))
_SECTION_FIELDS = {n: tuple(f.name for f in dataclasses.fields(c)) for n, c in _SECTIONS.items()}


def model_key(m: ModelConfig) -> tuple:
    """A hashable key of a model config (for caches); model_from_key(model_key(m)) == m."""
    return tuple(tuple(getattr(getattr(m, n), f) for f in _SECTION_FIELDS[n]) if n in _SECTION_FIELDS
                 else getattr(m, n) for n in _MODEL_FIELDS)


def model_from_key(key: tuple) -> ModelConfig:
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    return ModelConfig(**{n: _SECTIONS[n](*v) if n in _SECTIONS else v for n, v in zip(names, key)})


def kind_keys(kind: str) -> list[str]:
    """The [model] keys that do not apply to model.kind = `kind`."""
    return [f.name for f in dataclasses.fields(ModelConfig) if kind not in f.metadata.get("kinds", (kind,))]


def _kind_error(key: str, kind: str) -> ConfigError:
    kinds = next(f.metadata["kinds"] for f in dataclasses.fields(ModelConfig) if f.name == key)
    return ConfigError(f"model.{key} applies to model.kind = {' or '.join(map(repr, kinds))}, not {kind!r}: "
                       f"remove it, or set model.kind to {' or '.join(map(repr, kinds))}")


def ffn_width(m: "ModelConfig") -> int:
    """The SwiGLU hidden width of a llama config: ffn_hidden, or Llama's rule (int(8/3 x d_model) rounded up
    to ffn_multiple_of)."""
    if m.ffn_hidden:
        return m.ffn_hidden
    return -(-int(2 * 4 * m.d_model / 3) // m.ffn_multiple_of) * m.ffn_multiple_of


def head_width(m: "ModelConfig") -> int:
    """The width of one attention head: model.head_dim, or d_model / n_heads when it is 0 (the gpt kind always)."""
    return m.head_dim or m.d_model // m.n_heads


@dataclass
class DataSource:
    """One token file of a blend, a `[[data.sources]]` table."""
    path: str = _f("", "HDF5 token file", check=(bool, "must name a token file"))
    weight: float = _f(1.0, "share of each batch's rows drawn from this file, relative to the other weights",
                       check=_must(">", 0))


@dataclass
class DataConfig:
    """Where tokens come from."""
    path: str = _f("", 'HDF5 token file; "" = built-in corpus (or the data.sources blend)')
    val_path: str = _f("", 'HDF5 token file that is the whole validation split (all of the training files then '
                       'train); "" = split each training file by data.val_fraction')
    val_fraction: float = _f(0.05, "share of each training file held out for validation: its last documents, "
                             "from the first document boundary at or after (1 - val_fraction) x its tokens "
                             "(a file without document boundaries is split at that token)",
                             check=_must(">", 0, "<", 1))
    sources: list[DataSource] = _f([], "token files blended by weight, as `[[data.sources]]` tables (path, weight); "
                                   "each batch row picks its file by weight; data.path must then be empty")
    document_mask: bool = _f(False, "packed documents: attention never crosses a document boundary, positions restart "
                             "at each document, no loss on a prediction across a boundary")


@dataclass
class TrainConfig:
    """The training loop."""
    steps: int = _f(300, "optimizer steps to run", check=_POS)
    global_batch: int = _f(8, "sequences per optimizer step, fixed by (seed, step) whatever the layout",
                           check=_POS)
    seed: int = _f(1234, "seed for initialisation and batch sampling")
    eval_every: int = _f(100, "evaluate every N steps; 0 = never", check=_must(">=", 0))
    eval_batches: int = _f(4, "validation batches per evaluation", check=_POS)
    log_every: int = _f(10, "log a metrics line every N steps", check=_POS)
    out_dir: str = _f("runs/default", "run folder (refused if it already holds results)")
    models: int = _f(1, "train this many models together in one job (a seed or learning-rate sweep): each rank "
                        "holds the same share of each, and one set of collectives per step serves them all",
                     check=_POS)
    model_seeds: list[int] = _f([], "per-model seeds (init and data); empty = seed, seed+1, ...")
    model_lrs: list[float] = _f([], "per-model peak learning rates; empty = optim.lr for every model")


@dataclass
class OptimConfig:
    """The optimizer, learning-rate schedule and gradient clipping."""
    name: str = _f("adamw", "the optimizer: AdamW (bias correction, decoupled weight decay of decayed tensors), "
                   "Muon for the blocks' weight matrices (routers excepted) with AdamW for the other tensors, or "
                   "plain SGD (p -= lr g, the same decoupled weight decay; no state)",
                   choices=("adamw", "muon", "sgd"))
    lr: float = _f(3e-3, "peak learning rate", check=_must(">=", 0))
    betas: list[float] = _f([0.9, 0.95], "Adam (beta1, beta2)", check=_BETAS)
    eps: float = _f(1e-8, "Adam epsilon", check=_must(">", 0))
    weight_decay: float = _f(0.1, "decoupled (AdamW) weight decay of decayed tensors", check=_must(">=", 0))
    warmup_steps: int = _f(30, "linear warm-up steps: step i < warmup_steps runs at lr x (i+1) / warmup_steps",
                           check=_must(">=", 0))
    schedule: str = _f("cosine", "learning-rate decay after warm-up",
                       choices=("cosine", "linear", "constant"))
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of lr",
                             check=_must(">=", 0, "<=", 1))
    clip_grad_norm: float = _f(1.0, "clip the global gradient norm to this; 0 = off", check=_must(">=", 0))
    muon_momentum: float = _f(0.95, "muon: momentum of the buffer the update is orthogonalised from",
                              check=_must(">=", 0, "<", 1))
    muon_nesterov: bool = _f(True, "muon: Nesterov momentum (orthogonalise the gradient lerped toward the buffer)")
    muon_ns_steps: int = _f(5, "muon: Newton-Schulz iterations", check=_must(">=", 1, "<", 100))
    muon_ns_coefficients: list[float] = _f([3.4445, -4.775, 2.0315], "muon: Newton-Schulz (a, b, c) of "
                                           "X <- a X + (b A + c A^2) X, A = X X^T", check=_THREE)
    muon_lr_adjust: str = _f("match_rms_adamw", "muon: lr of an out x in matrix: lr x 0.2 sqrt(max(out, in)) "
                             "(AdamW's update RMS), lr x sqrt(max(1, out/in)) (original) or lr (none)",
                             choices=("match_rms_adamw", "original", "none"))
    muon_qk_clip: float = _f(0.0, "muon: MuonClip threshold tau on the largest attention logit (the scaled q.k the "
                             "softmax reads) per head; after each update a head above it has its q and k weights "
                             "scaled down to tau; 0 = off", check=_must(">=", 0))


@dataclass
class DataParallelConfig:
    """Replicas of the model; gradients averaged across them (communicator `dp`)."""
    enable: bool = _f(False, "turn data parallelism on")
    degree: int = _f(-1, _DEGREE_DOC, check=_DEGREE)
    bucket_mb: float = _f(4.0, "gradient all-reduce bucket size in MiB", check=_must(">", 0))


@dataclass
class ShardingConfig:
    """Optimizer state (stage 1), + gradients (2), + parameters (3) split across ranks (`sharding`)."""
    enable: bool = _f(False, "turn sharding on")
    degree: int = _f(-1, _DEGREE_DOC, check=_DEGREE)
    stage: int = _f(1, "1 = optimizer state, 2 = + gradients, 3 = + parameters", choices=(1, 2, 3))
    partition: str = _f("tensor", "whole tensors balanced by element count, or equal element ranges",
                        choices=("tensor", "flat"))


@dataclass
class PipelineConfig:
    """Consecutive blocks on consecutive ranks; micro-batches flow through a schedule (`pp`)."""
    enable: bool = _f(False, "turn pipeline parallelism on")
    degree: int = _f(-1, _DEGREE_DOC, check=_DEGREE)
    micro_batches: int = _f(1, "micro-batches each pass is split into", check=_POS)
    schedule: str = _f("1f1b", "order of forward/backward micro-steps: fthenb (GPipe), 1f1b, interleaved "
                       "(virtual_stages >= 2), or zero bubble, each backward split into its input and weight "
                       "gradients: zb1p (ZB-H1, 1f1b's activation memory) and zbv (ZB-V, two chunks per rank in a V, "
                       "micro_batches >= 2 x degree - 1)",
                       choices=("fthenb", "1f1b", "interleaved", "zb1p", "zbv"))
    virtual_stages: int = _f(1, "model chunks per rank (interleaved schedule; zbv always has 2)", check=_POS)
    split: str | list[int] = _f("uniform", 'blocks per stage: "uniform", "params" (balance parameter '
                                "counts) or a list of block counts", check=_SPLIT)
    scatter_gather: bool = _f(True, "with tensor parallelism (and no sequence parallelism): each tp rank sends "
                              "1/tp of an activation to the next stage, which all-gathers it over tp (Megatron's "
                              "scatter/gather); false sends the whole activation from every tp rank")


@dataclass
class ExpertParallelConfig:
    """Routed experts split over ranks (llama-kind MoE models), tokens moved to them by all-to-all."""
    enable: bool = _f(False, "turn expert parallelism on")
    degree: int = _f(-1, "ranks the experts are split over, folded inside data_parallel x sharding (no extra "
                     "ranks); must divide dp x sharding and model.moe.num_experts (one that does not divide dp keeps "
                     "each rank's expert block whole under sharding); -1 = every data-parallel rank", check=_DEGREE)


@dataclass
class TensorParallelConfig:
    """Each matrix split across ranks, Megatron column/row style (`tp`)."""
    enable: bool = _f(False, "turn tensor parallelism on")
    degree: int = _f(-1, _DEGREE_DOC, check=_DEGREE)
    sequence_parallel: bool = _f(False, "split the norms, residuals and their caches along the sequence across the "
                                 "tp ranks (Korthikanti et al. 2022): allreduces become reduce-scatter + all-gather, "
                                 "activation memory outside attention and the MLP drops by the tp degree; needs "
                                 "model.seq_len divisible by the degree")


@dataclass
class ContextParallelConfig:
    """Each sequence split over ranks in head-tail balanced chunks; attention by a ring of keys (`cp`)."""
    enable: bool = _f(False, "turn context parallelism on")
    degree: int = _f(-1, _DEGREE_DOC + "; model.seq_len must be divisible by 2 x degree", check=_DEGREE)
    comm: str = _f("ring", "how keys and values travel: ring (each rank's block passed on while the held one is "
                   "attended; two blocks held at a time) or allgather (every block gathered once, dk and dv "
                   "reduce-scattered back)", choices=("ring", "allgather"))


@dataclass
class RecomputeConfig:
    """Drop block activations in forward, rebuild them in backward (memory for compute)."""
    enable: bool = _f(False, "turn activation recomputation on")
    every: int = _f(1, "recompute every N-th block", check=_POS)
    granularity: str = _f("full", 'what a recomputed block drops: "full" keeps only its input; "selective" keeps '
                          "everything but the attention probabilities, rebuilt in backward from the cached q and k "
                          "(the mlp kind and flash attention keep no probabilities: nothing is dropped)",
                          choices=("full", "selective"))


@dataclass
class GradientMergeConfig:
    """Accumulate k micro-steps before one optimizer step."""
    enable: bool = _f(False, "turn gradient merge on")
    k_steps: int = _f(1, "sequential passes per optimizer step", check=_POS)


@dataclass
class AmpConfig:
    """Low-precision compute, float32 master weights, dynamic loss scaling."""
    enable: bool = _f(False, "turn mixed precision on")
    dtype: str = _f("float16", "compute dtype: float16, or bfloat16 (bf16 values in float32 storage, "
                    "hpengine/device/precision.py, activation caches as bf16_storage says; every GEMM with bf16 operands and float32 sums, nn/bf16_gemm.py)", choices=("float16", "bfloat16"))
    loss_scaling: str = _f("auto", "dynamic loss scaling: auto (on for float16, off for bfloat16), dynamic, off",
                           choices=("auto", "dynamic", "off"))
    grad_dtype: str = _f("float32", "bfloat16 only: dtype gradients are kept in between sums (float32 as Megatron, "
                         "or bfloat16: rounded after each sum, 2 bytes an element under packed bf16_storage; "
                         "the sums still move float32)", choices=("float32", "bfloat16"))
    bf16_storage: str = _f("auto", "bfloat16 only: how the activations a block keeps for its backward (and, "
                           "inside a block, what only GEMMs or bfloat16 kernels read) and the "
                           "parameters' compute copy are stored: packed (bfloat16 bits, 2 bytes an element), "
                           "float32 (bf16 values in float32, 4 bytes), "
                           "auto (packed on a GPU backend, float32 on NumPy); both give the same values",
                           choices=("auto", "float32", "packed"))
    init_scale: float = _f(65536.0, "initial loss scale", check=_must(">", 0))
    growth_interval: int = _f(1000, "overflow-free steps before the scale grows", check=_POS)
    backoff: float = _f(0.5, "scale multiplier after an overflow", check=_must(">", 0, "<", 1))
    growth_factor: float = _f(2.0, "scale multiplier after growth_interval clean steps", check=_must(">", 1))
    max_skipped: int = _f(100, "stop a diverged run (exit 2, this model not saved) after this many steps in a row "
                          "skipped for an overflow; it also stops once the scale falls under 2**-24; 0 = that "
                          "floor alone", check=_must(">=", 0))


@dataclass
class DilocoConfig:
    """DiLoCo (Douillard et al. 2023): islands of ranks, each training with its own inner layout and optimizer, that
    meet every inner_steps steps for an outer Nesterov step on the averaged pseudo-gradient (communicator `replica`,
    outermost)."""
    enable: bool = _f(False, "turn DiLoCo on")
    replicas: int = _f(-1, "islands (M), each with the inner layout the other strategies describe; the global batch "
                       "is split over them; -1 = the ranks left over", check=_DEGREE)
    inner_steps: int = _f(50, "H: optimizer steps of each island between two outer steps", check=_POS)
    outer_lr: float = _f(0.7, "outer learning rate", check=_must(">", 0))
    outer_momentum: float = _f(0.9, "outer momentum mu (PyTorch SGD: buf = mu buf + g)", check=_must(">=", 0, "<", 1))
    nesterov: bool = _f(True, "Nesterov outer momentum: step = g + mu buf (else buf)")
    quantize: str = _f("none", "the outer exchange: none (an allreduce in the parameters' dtype), or int8 / int4 "
                       "per block of 256 values with a float32 scale each, with error feedback: each island averages and "
                       "re-quantises its chunk of the blocks (alltoallv), then all gather the chunks",
                       choices=("none", "int8", "int4"))
    fragments: int = _f(1, "streaming DiLoCo: the model's tensors in F groups of whole tensors in model order "
                        "(balanced by element count, the same under every layout), fragment f synchronised at the "
                        "steps where (step - f H / F) is a multiple of H; 1 = all at once", check=_POS)
    overlap: bool = _f(False, "streaming DiLoCo: an outer exchange runs under the next inner steps (non-blocking) "
                       "and lands inner_steps / fragments steps later, mixed into the island's values")
    overlap_mix: float = _f(0.5, "overlap: alpha when an exchange lands: island = alpha island + (1 - alpha) outer "
                            "(Streaming DiLoCo's merge; 0 = restart from the new outer parameters)",
                            check=_must(">=", 0, "<=", 1))


@dataclass
class StrategyConfig:
    """The switchable strategies; any subset may be enabled."""
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    gradient_merge: GradientMergeConfig = field(default_factory=GradientMergeConfig)
    amp: AmpConfig = field(default_factory=AmpConfig)
    expert_parallel: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)
    context_parallel: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)


@dataclass
class CheckpointConfig:
    """Checkpoint cadence and retention."""
    dir: str = _f("", 'checkpoint folder; "" = `<out_dir>/checkpoints`')
    every: int = _f(0, "save every N steps; 0 = never", check=_must(">=", 0))
    every_minutes: float = _f(30.0, "also save when this many minutes of wall time have passed since the last "
                                    "save (decided together at a step boundary), so a job killed without warning "
                                    "loses at most that much; 0 = off", check=_must(">=", 0))
    keep: int = _f(3, "most recent checkpoints kept", check=_POS)
    async_: bool = _f(True, "write checkpoints in the background: a save costs training only the time to prepare "
                            "its folder, each rank's writer thread writes its shard while the next steps run, and "
                            "the manifest is published once every writer has finished; false = every rank waits "
                            "until the checkpoint is on disk", key="async")
    at_end: bool = _f(True, "save a checkpoint after the last step (unless `every` already saved it), so every "
                            "run leaves a model for `hpengine eval` and `--resume`")
    init_from: str = _f("", "start from the parameters of an exported checkpoint file (hpengine ckpt export), "
                            'or "hf:DIR" for a local Hugging Face model folder (config.json and safetensors '
                            "weights of a GPT2LMHeadModel -> gpt or LlamaForCausalLM -> llama, shaped as "
                            "[model]); optimizer state starts fresh")


@dataclass
class RuntimeConfig:
    """Array backend and MPI transport."""
    backend: str = _f("auto", "array backend; auto = cupy when a GPU is visible, else numpy",
                      choices=("auto", "numpy", "cupy"))
    cuda_aware_mpi: bool | str = _f("auto", 'hand device buffers straight to MPI: "auto" (when the MPI library '
                                    'says it can), true, or false (stage through pinned host memory)',
                                    check=(lambda v: v in (True, False, "auto"), 'must be "auto", true or false'))
    collectives: str = _f("mpi", 'what carries collectives on device buffers: "mpi", or "nccl" (each mesh '
                          "communicator gets an NCCL twin for allreduce, reduce-scatter, all-gather and broadcast, "
                          "and the pipeline's and the context-parallel ring's sends and receives go on directed "
                          "NCCL channels; MPI keeps start-up, control messages and host buffers; where NCCL is "
                          "missing on some rank or the backend resolves to NumPy, every rank warns and uses MPI)",
                          choices=("mpi", "nccl"))
    share_devices: bool = _f(False, "allow more ranks on a node than GPUs (ranks share devices; logged as a "
                                    "warning)")
    blas_threads: int = _f(0, "threads of each rank's CPU BLAS/OpenMP pool; 0 = automatic: the cores the rank is "
                           "bound to divided by the ranks on its node bound to overlapping cores, at least 1, "
                           "unless OMP_NUM_THREADS, OPENBLAS_NUM_THREADS or MKL_NUM_THREADS is set (then those count)", check=_must(">=", 0))
    matmul_precision: str = _f("highest", "float32 GEMMs on the GPU: highest (full float32) or tf32 (tensor "
                               "cores, 10-bit mantissa inputs, float32 accumulation); no effect on NumPy",
                               choices=("highest", "tf32"))
    watchdog_s: float = _f(0.0, "abort the job when a step takes longer than this (seconds; start-up, loads, "
                           "evaluation and saves get 10x, at least 300 s); 0 = off",
                           check=_must(">=", 0))
    replica_link: str = _f("", 'a simulated slow link on the communicator link_axis names, "BANDWIDTH,LATENCY" such as '
                           '"1Gbit/s,50ms" (units bit/s, kbit/s, Mbit/s, Gbit/s, B/s, kB/s, MB/s, GB/s; s, ms, us): '
                           "each call there completes no earlier than its turn on the link (bytes / bandwidth, one "
                           'message after another) plus the latency (a sleep, traced as "replica link" or "dp '
                           'link"); "" = off', check=(
                               lambda v: v == "" or _link_ok(v), 'must be "" or "BANDWIDTH,LATENCY", e.g. '
                               '"1Gbit/s,50ms"'))
    link_axis: str = _f("replica", "the communicator runtime.replica_link slows: replica (DiLoCo's islands) or dp "
                        "(data parallel's gradient communicator: data parallel over the same simulated link, to "
                        "compare the two)", choices=("replica", "dp"))
    memory_check: bool = _f(True, "refuse to start when the planner's predicted memory per rank exceeds what "
                            "the rank has (MemAvailable / ranks on the node; free device memory on a GPU)")
    trace: bool = _f(False, "record a timeline (compute per micro-batch, every MPI call with its bytes); "
                     "trace.json in the run folder, for Perfetto and `hpengine plot`")
    trace_max_events: int = _f(200000, "most timeline events kept per rank (the latest; bounds the trace's "
                               "memory)", check=_POS)
    tensorboard: bool = _f(False, "write TensorBoard event files (loss, val loss, lr, grad norm, loss scale, "
                           "tokens/s, MFU) into <out_dir>/tensorboard/ (rank 0; no extra package needed)")
    peak_tflops: float = _f(0.0, "peak dense TFLOP/s of one rank's device that MFU is measured against; 0 = "
                            "automatic: NVIDIA's datasheet figure for an H100, H200 or A100 at the run's "
                            "precision, a float GEMM timed on one core on the CPU", check=_must(">=", 0))


@dataclass
class ResilienceConfig:
    """What a rank's death does to the job (spare and shrink need Open MPI's ULFM: `mpirun --with-ft ulfm`)."""
    on_failure: str = _f("abort", 'when a rank dies: "abort" (the job ends), "spare" (an idle spare rank takes the '
                         'dead rank\'s place and the interrupted step is run again) or "shrink" (a spare while there is one, '
                         'else the dead rank\'s data-parallel replica leaves and dp, or sharding, falls by one)',
                         choices=("abort", "spare", "shrink"))
    spares: int = _f(0, "extra ranks started idle (launch ranks + spares): they join the world but not the mesh "
                     "and wait until a rank dies", check=_must(">=", 0))
    buddy: bool = _f(True, "keep a copy of each rank's state (parameters, optimizer state, step) in the host "
                     "memory of another rank, on another node when there is one, refreshed after every step")


@dataclass
class MeshConfig:
    """How ranks are laid out on the mesh axes."""
    order: list[str] = _f(list(MESH_AXES), "mesh axes, innermost (neighbouring ranks) first; "
                          "a permutation of tp, cp, sharding, dp, pp (an order without cp puts it right after tp)",
                          check=_ORDER)


@dataclass
class Config:
    """A whole training job. `given` (not a key) is set by load_config: the dotted keys the config file and
    --set gave, None for a Config built in code; `valid_as` (not a key): the values validate last passed."""
    given = None
    valid_as = None
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
