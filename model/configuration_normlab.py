"""NormLabConfig: the encoder's hyper-parameters, with the norm and its placement as first-class fields. Every
field is typed and checked when the config is built, so a typo in `norm=` fails at once, listing the choices."""

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .norm_code import check_norm_code, save_norm_code

# The norm names and the batch-statistics family come from the registry (norms.py), read when a config is checked.
from .norms import NORM_TYPES, norm_class, uses_batch_statistics

# A saved model's copy of this module registers the norms it carries that NormLab does not define (norm_code.py).
from .saved_norms import SAVED_NORMS  # noqa: F401 - imported for its registrations

NORM_PLACEMENTS = ("post", "pre", "sandwich", "deepnorm")
# Placements whose residual stream is never normalized inside the blocks: they need a norm after the last one.
PLACEMENTS_WITH_FINAL_NORM = ("pre", "sandwich")
POOLINGS = ("cls", "mean")
# What may stand between pooling and the classifier: the batch's mean removed, or each feature standardized by the
# batch's mean and standard deviation (BatchCentering, BatchStandardization; both parameter-free).
POOLED_NORMS = ("center", "standardize")
HIDDEN_ACTS = ("gelu", "relu", "gelu_new", "silu")


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"NormLabConfig.{name}={value!r} is not valid; choose one of: {', '.join(choices)}")


def _check_positive(name, value, meaning=None):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        what = f" ({meaning})" if meaning else ""
        raise ValueError(f"NormLabConfig.{name}={value!r} must be a positive integer{what}")


def _check_probability(name, value):
    if value is not None and not 0.0 <= value < 1.0:
        raise ValueError(f"NormLabConfig.{name}={value!r} must be in [0, 1)")


@strict
class NormLabConfig(PreTrainedConfig):
    r"""
    Configuration of a NormLab encoder. BERT-shaped (learned absolute positions, token types, GELU feed-forward),
    except that the normalization layer (`norm`) and where it sits in a block (`norm_placement`) are chosen here.

    Args:
        norm: one of `NORM_TYPES`, the names registered in norms.py's `NORM_REGISTRY` (NormLab's, and those a user
            registered with `register_norm`), or `module:Class` of a norm of one's own, imported when the config is
            built and kept as written (docs/model.md, "A norm of your own").
        norm_placement: `post` (BERT: norm(x + f(x))), `pre` (x + f(norm(x)), final norm after the last block),
            `sandwich` (Peri-LN: x + norm_out(f(norm_in(x)))), `deepnorm` (post with residual scaled by
            (2N)^(1/4) and some projections initialised with gain (8N)^(-1/4); Wang et al. 2022).
        norm_eps: epsilon inside the square root of every norm.
        final_norm: the norm after the last block of `pre`/`sandwich`, the one just before pooling and the
            classifier; a `NORM_TYPES` name. `None` (the default) is `norm`, as every model before this field.
        embedding_norm: normalize the embedding output (a `norm`). `None` picks the usual choice for the placement:
            yes for `post`/`deepnorm` (BERT), no for `pre`/`sandwich` (GPT-2/Megatron style).
        bn_momentum: running-statistics momentum of the batch-statistics norms (torch convention).
        bn_group_size: ghost batches: the batch-statistics norms (block, final, pooled-vector) take their statistics
            per group of this many consecutive sentences of the batch (real tokens only where the norm masks), not
            over the whole batch; a last run of fewer sentences joins the group before it. `None` (the default):
            the whole batch. Changes the noise of the statistics, not the optimizer's batch (docs/model.md).
        powernorm_alpha_fwd, powernorm_alpha_bkw, powernorm_warmup_steps: PowerNorm (Shen et al. 2020, Alg. 1).
        dyt_alpha_init: initial scalar alpha of DyT (Zhu et al. 2025).
        qk_norm: normalize queries and keys per head before the dot product (Wortsman et al. 2023).
        pooling: `cls` (first token) or `mean` (over real tokens) for sequence classification.
        pooled_norm: a parameter-free batch-statistics step between pooling and the classifier: `center`
            subtracts the batch's mean pooled vector (`BatchCentering`), `standardize` also divides each feature by
            its batch standard deviation (`BatchStandardization`); running statistics in eval, ghost groups as the
            norms. `None` (the default): none.
        pooled_gain: a fixed factor on what the classifier reads (after `pooled_norm`); 1 (the default) changes
            nothing. With `center`, a gain near 1 / the pooled vector's per-feature SD gives the classifier an input
            as large as standardization does, but fixed instead of measured on each batch.
        center_pooled: the first spelling of `pooled_norm="center"`, kept so that saved configs mean what they
            meant; after the config is built it is True exactly when `pooled_norm` is `center`.
    """

    model_type = "normlab"

    vocab_size: int = 8000
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 512
    hidden_act: str = "gelu"
    hidden_dropout_prob: float | int = 0.1
    attention_probs_dropout_prob: float | int = 0.1
    max_position_embeddings: int = 128
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    norm: str = "layernorm"
    norm_placement: str = "pre"
    norm_eps: float = 1e-5
    final_norm: str | None = None
    embedding_norm: bool | None = None
    bn_momentum: float = 0.1
    bn_group_size: int | None = None
    powernorm_alpha_fwd: float = 0.9
    powernorm_alpha_bkw: float = 0.9
    powernorm_warmup_steps: int = 1000
    dyt_alpha_init: float = 0.5
    qk_norm: bool = False
    pooling: str = "cls"
    pooled_norm: str | None = None
    pooled_gain: float | int = 1.0
    center_pooled: bool = False
    classifier_dropout: float | int | None = None
    pad_token_id: int | None = 0
    tie_word_embeddings: bool = True

    def __post_init__(self, **kwargs):
        self._check_values()
        if self.embedding_norm is None:
            self.embedding_norm = self.norm_placement in ("post", "deepnorm")
        if self.final_norm is None:
            self.final_norm = self.norm
        if self.center_pooled and self.pooled_norm is None:
            self.pooled_norm = "center"
        self.center_pooled = self.pooled_norm == "center"
        super().__post_init__(**kwargs)

    def _check_values(self):
        # Called from __post_init__, not a `validate_*` hook: a plain ValueError, not huggingface_hub's wrapper.
        norm_class(self.norm, key="NormLabConfig.norm")
        _check_choice("norm_placement", self.norm_placement, NORM_PLACEMENTS)
        _check_choice("pooling", self.pooling, POOLINGS)
        if self.final_norm is not None:
            norm_class(self.final_norm, key="NormLabConfig.final_norm")
            if self.final_norm != self.norm and self.norm_placement not in PLACEMENTS_WITH_FINAL_NORM:
                raise ValueError(
                    f"NormLabConfig.final_norm={self.final_norm!r} needs a placement with a final norm "
                    f"({', '.join(PLACEMENTS_WITH_FINAL_NORM)}); norm_placement={self.norm_placement!r} has none"
                )
        _check_choice("hidden_act", self.hidden_act, HIDDEN_ACTS)
        self._check_pooled()
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings"):
            _check_positive(name, getattr(self, name))
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"NormLabConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; choose a head count that divides it"
            )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            _check_probability(name, getattr(self, name))
        if not self.norm_eps > 0:
            raise ValueError(f"NormLabConfig.norm_eps={self.norm_eps!r} must be > 0")
        if not 0.0 < self.bn_momentum <= 1.0:
            raise ValueError(f"NormLabConfig.bn_momentum={self.bn_momentum!r} must be in (0, 1]")
        if self.bn_group_size is not None:
            _check_positive("bn_group_size", self.bn_group_size, "sentences per group, or None for the whole batch")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"NormLabConfig.pad_token_id={self.pad_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )

    def _check_pooled(self):
        if self.pooled_norm is not None:
            _check_choice("pooled_norm", self.pooled_norm, POOLED_NORMS)
        if self.center_pooled and self.pooled_norm not in (None, "center"):
            raise ValueError(f"NormLabConfig.center_pooled=True means pooled_norm='center', which contradicts "
                             f"pooled_norm={self.pooled_norm!r}; give pooled_norm alone")
        if isinstance(self.pooled_gain, bool) or not 0 < self.pooled_gain < float("inf"):
            raise ValueError(f"NormLabConfig.pooled_gain={self.pooled_gain!r} must be a finite number > 0 (1: no gain)")

    def save_pretrained(self, save_directory, *args, **kwargs):
        """PreTrainedConfig's; refused, before config.json or a model's weights are written, when a norm's code
        cannot travel. The modules of the norms NormLab does not define are saved beside the model code
        (norm_code.py), so that the folder loads with `trust_remote_code=True` where their package is absent."""
        check_norm_code(self)
        super().save_pretrained(save_directory, *args, **kwargs)
        save_norm_code(self, save_directory)

    def norms_used(self) -> tuple[str, ...]:
        """The `NORM_TYPES` names this model builds: the blocks' (also the embeddings' and the MLM head's), then
        the final norm where the placement has one."""
        has_final = self.norm_placement in PLACEMENTS_WITH_FINAL_NORM
        return (self.norm, self.final_norm or self.norm) if has_final else (self.norm,)

    @property
    def uses_batch_statistics(self) -> bool:
        """True when some output depends on the batch in training and running statistics exist: a BN-family norm
        anywhere, or the pooled vector's batch centring or standardization. The question before a model exists; a
        model lists its modules of that family (`batch_statistics_norms()`)."""
        return self.pooled_norm is not None or any(uses_batch_statistics(n) for n in self.norms_used())


__all__ = ["NormLabConfig", "NORM_TYPES", "NORM_PLACEMENTS", "PLACEMENTS_WITH_FINAL_NORM", "POOLINGS", "POOLED_NORMS"]
