"""Layer library: pure forward/backward function pairs over an array module `xp`.
Backwards accumulate (+=) into the gradient views they are handed and return
the input gradient (docs/architecture.md, "Layers"). Each module also says how many elements
its forward caches, which the planner's memory model reads.
"""
from hpengine.nn.activation import (
                         gelu_backward,
                         gelu_cache_elements,
                         gelu_forward,
                         gelu_recompute,
                         relu_backward,
                         relu_forward,
)
from hpengine.nn.attention import (
                         attention_backward,
                         attention_cache_elements,
                         attention_drop_scores,
                         attention_forward,
                         attention_restore_scores,
                         score_elements,
)
from hpengine.nn.deferred import Deferred, run_all, weight_grad
from hpengine.nn.embedding import (
                         embedding_backward,
                         embedding_backward_input,
                         embedding_backward_weight,
                         embedding_cache_bytes,
                         embedding_forward,
)
from hpengine.nn.gqa import (
                         gqa_attention_backward,
                         gqa_attention_forward,
                         gqa_cache_elements,
                         gqa_drop_scores,
                         gqa_restore_scores,
)
from hpengine.nn.layernorm import (
                         layernorm_backward,
                         layernorm_backward_input,
                         layernorm_backward_weight,
                         layernorm_cache_elements,
                         layernorm_forward,
)
from hpengine.nn.linear import (
                         linear_backward,
                         linear_backward_input,
                         linear_backward_weight,
                         linear_drop_input,
                         linear_forward,
                         linear_restore_input,
)
from hpengine.nn.loss import cross_entropy_backward, cross_entropy_forward
from hpengine.nn.numerics import OFF, Numerics
from hpengine.nn.rmsnorm import (
                         rmsnorm_backward,
                         rmsnorm_backward_input,
                         rmsnorm_backward_weight,
                         rmsnorm_cache_bytes,
                         rmsnorm_forward,
)
from hpengine.nn.rope import rope_backward, rope_forward, rope_tables
from hpengine.nn.swiglu import (
                         swiglu_backward,
                         swiglu_cache_elements,
                         swiglu_forward,
                         swiglu_recompute,
)

__all__ = [
    "linear_forward", "linear_backward",
    "embedding_forward", "embedding_backward",
    "layernorm_forward", "layernorm_backward",
    "linear_drop_input", "linear_restore_input", "gelu_recompute",
    "gelu_forward", "gelu_backward", "relu_forward", "relu_backward",
    "attention_forward", "attention_backward", "attention_drop_scores", "attention_restore_scores",
    "cross_entropy_forward", "cross_entropy_backward",
    "layernorm_cache_elements", "gelu_cache_elements", "attention_cache_elements", "score_elements",
    "embedding_cache_bytes",
    "rmsnorm_forward", "rmsnorm_backward", "rmsnorm_cache_bytes", "rope_tables", "rope_forward", "rope_backward",
    "swiglu_forward", "swiglu_backward", "swiglu_recompute", "swiglu_cache_elements",
    "gqa_attention_forward", "gqa_attention_backward", "gqa_cache_elements", "gqa_drop_scores", "gqa_restore_scores",
    # split backwards: the input half (B) and the weight half (W) of each weight-carrying layer
    "linear_backward_input", "linear_backward_weight", "layernorm_backward_input", "layernorm_backward_weight",
    "rmsnorm_backward_input", "rmsnorm_backward_weight", "embedding_backward_input", "embedding_backward_weight",
    "Deferred", "run_all", "weight_grad",
    # the bf16 storage and GEMM-operand policy a layer is handed (num=)
    "Numerics", "OFF",
]
