"""The configuration of a course transformer: one frozen dataclass (a value: hashable, safe to share).

``minidist.models.transformer`` builds the model from it; ``bert.CONFIGS`` and ``decoder.CONFIGS``
are instances. Its fields after ``init_std`` choose mixtures of experts and newer decoders'
blocks (``modern_blocks``); their defaults keep the GPT/BERT blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist.models.modern_blocks import MLAConfig

__all__ = ["TransformerConfig"]


@dataclass(frozen=True)
class TransformerConfig:
    """Shape and options of one transformer; frozen so that a config is a value (hashable, safe to share).

    ``position`` is ``"learned"`` (a table of ``max_positions`` vectors added to the word
    vectors: BERT, GPT, OPT) or ``"alibi"`` (no position table; each head adds
    ``-slope * (i - j)`` to the score of query i for key j: BLOOM).
    ``type_vocab_size`` is the number of segment embeddings (2 for BERT's sentence A/B, 0 for none).
    ``intermediate_size`` 0 means 4 * hidden_size.

    Mixture of experts (``num_experts`` 0: dense): ``top_k``, ``moe_d_ffn`` (0: ffn_size),
    ``num_shared_experts``, ``first_dense_layers`` (dense blocks before the first MoE block),
    ``capacity_factor`` (None: no drops), ``aux_loss_coef`` (Switch's 0.01).
    Newer decoders (``modern_blocks``): ``position="rope"`` (``rope_theta``), ``n_kv_heads`` (0: n_heads),
    ``norm`` "layernorm" | "rmsnorm", ``activation`` "gelu" | "swiglu", ``bias``, ``mla``,
    ``tie_word_embeddings`` (the decoder's output matrix is the word table, or its own).
    """

    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    max_positions: int
    intermediate_size: int = 0
    type_vocab_size: int = 0
    position: str = "learned"
    causal: bool = False
    pre_ln: bool = False
    embedding_layernorm: bool = True
    dropout: float = 0.0
    layer_norm_eps: float = 1e-12
    init_std: float = 0.02
    num_experts: int = 0
    top_k: int = 2
    moe_d_ffn: int = 0
    num_shared_experts: int = 0
    first_dense_layers: int = 0
    capacity_factor: float | None = 1.25
    aux_loss_coef: float = 0.01
    n_kv_heads: int = 0
    norm: str = "layernorm"
    activation: str = "gelu"
    bias: bool = True
    rope_theta: float = 10000.0
    mla: MLAConfig | None = None
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.hidden_size % self.n_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by n_heads {self.n_heads}: "
                "each head gets hidden_size / n_heads dimensions; pick n_heads that divides it"
            )
        if self.position not in ("learned", "alibi", "rope"):
            raise ValueError(f"position must be 'learned', 'alibi' or 'rope', got {self.position!r}")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_kv_heads {self.n_kv_heads} must divide n_heads {self.n_heads} (query heads per K/V head)"
            )
        if self.norm not in ("layernorm", "rmsnorm") or self.activation not in ("gelu", "swiglu"):
            raise ValueError(f"norm is 'layernorm' or 'rmsnorm', activation 'gelu' or 'swiglu': {self}")
        if isinstance(self.mla, dict):  # read back from JSON (shards' metadata, dataclasses.asdict)
            object.__setattr__(self, "mla", MLAConfig(**self.mla))
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in 1..num_experts={self.num_experts}, got {self.top_k}")
        if min(self.vocab_size, self.hidden_size, self.n_layers, self.n_heads, self.max_positions) < 1:
            raise ValueError(f"sizes must be positive: {self}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) has a mixture of experts instead of the dense MLP."""
        return self.num_experts > 0 and layer >= self.first_dense_layers

    @property
    def classic(self) -> bool:
        """True for the course's GPT/BERT blocks (none of the MoE or newer-decoder fields set)."""
        plain = (self.norm, self.activation, self.bias, self.position != "rope") == (
            "layernorm",
            "gelu",
            True,
            True,
        )
        return plain and not (self.num_experts or self.n_kv_heads or self.mla)
