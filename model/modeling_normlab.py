"""NormLab: a BERT-shaped Transformer encoder whose normalization layer and its placement come from the config.

- The norm: every norm of the model (the blocks', the embeddings', the final one, the MLM head's; not QK-norm) is
  `build_norm(config)`, the class `config.norm` names in norms.py's `NORM_REGISTRY`. A new norm is a class there
  and one registry line.
- Its placement: `config.norm_placement` (post, pre, sandwich, deepnorm) decides where `NormLabBlock` puts it.
Nothing else here changes when either does. Read top to bottom: embeddings -> attention -> feed-forward -> block ->
encoder -> the Hugging Face model classes and heads; the padding layout (`TokenLayout`) and the taps probes observe
are token_layout.py's.

Shapes: B batch, L padded length, D hidden, H heads, Dh = D // H. Inside the model activations are packed
(1, T, D), the T real tokens only, or padded (B, L, D) (`TokenLayout`; docs/model.md, "Padding"); every output
is (B, L, D) with zeros at pad positions.
"""

import torch
from torch import nn
from torch.nn import CrossEntropyLoss
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput, SequenceClassifierOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import can_return_tuple

from .configuration_normlab import PLACEMENTS_WITH_FINAL_NORM, NormLabConfig
from .norms import (
    NORM_REGISTRY,
    BatchCentering,
    BatchStandardization,
    Norm,
    batch_statistics_norms,
    build_norm,
    ghost_groups,
    set_batch_stats_in_eval,
)
from .token_layout import AttentionLogitsTap, Tap, TokenLayout


def deepnorm_alpha(num_layers: int) -> float:
    """DeepNet residual scale for an N-layer encoder-only model (Wang et al. 2022, Table 1): (2N)^(1/4)."""
    return (2 * num_layers) ** 0.25


def deepnorm_beta(num_layers: int) -> float:
    """DeepNet init gain of the ffn, value and output projections, encoder-only: (8N)^(-1/4)."""
    return (8 * num_layers) ** -0.25


def attention_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in: autocast's when autocast is on for the weights' device, else theirs."""
    if torch.is_autocast_enabled(weight.device.type):
        return torch.get_autocast_dtype(weight.device.type)
    return weight.dtype


class NormLabEmbeddings(nn.Module):
    """word + learned absolute position + token type, optionally normalized (config.embedding_norm), dropout."""

    def __init__(self, config: NormLabConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        # BERT normalizes here; pre-LN models usually don't (their first block normalizes its input anyway).
        self.norm = build_norm(config) if config.embedding_norm else None
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, layout: TokenLayout, token_type_ids=None, position_ids=None, inputs_embeds=None):
        # inputs_embeds (B, L, D) replaces the word-embedding lookup (prompt tuning, soft prompts)
        L = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        if L > self.position_embeddings.num_embeddings:
            raise ValueError(
                f"sequence length {L} exceeds max_position_embeddings={self.position_embeddings.num_embeddings}; "
                "truncate the input or build the model with a larger max_position_embeddings"
            )
        x = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds  # (B, L, D)
        # Default positions/types are slices of the tables added by broadcasting: no index tensors to build.
        if position_ids is None:
            x = x + self.position_embeddings.weight[:L]  # (L, D) broadcast over B
        else:
            x = x + self.position_embeddings(position_ids)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]  # (D,) type 0 everywhere
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        x = layout.pack(x)  # (B, L, D) or packed (1, T, D)
        if self.norm is not None:
            x = self.norm(x, layout.norm_mask)
        return self.dropout(x)


def eager_attention_forward(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0,
                            **kwargs):
    """softmax(q k^T * scaling + mask) v written out: what SDPA computes, with the weights kept. The signature of
    transformers' attention functions: (B, H, L, Dh) inputs -> ((B, L, H, Dh) output, weights (B, H, L, L))."""
    scores = torch.matmul(query, key.transpose(-2, -1)) * scaling  # (B, H, L, L)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)  # float32 sums, as SDPA's kernels
    dropped = module.attn_dropout(weights) if dropout > 0 else weights  # the module: a kernel package may swap it
    return torch.matmul(dropped, value).transpose(1, 2), weights


class NormLabAttention(nn.Module):
    """Multi-head self-attention: one fused qkv projection, optional QK-norm, then the attention function that
    `config._attn_implementation` names in transformers' AttentionInterface ("sdpa" by default), or the eager one
    when the attention weights are asked for. forward -> (output, weights (B, H, L, L) or None)."""

    def __init__(self, config: NormLabConfig):
        super().__init__()
        self.config = config  # read at call time: HF can switch the attention implementation after construction
        self.is_causal = False  # an encoder: every token sees every real token (read by HF's attention functions)
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scale = self.head_dim**-0.5
        # One (D -> 3D) matmul instead of three, rows ordered [query; key; value] (the layout convert.py writes).
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.attn_dropout = nn.Dropout(config.attention_probs_dropout_prob)  # on the attention weights
        # QK-norm (Wortsman et al. 2023) bounds the attention logits; always a LayerNorm (per token) by design.
        if config.qk_norm:
            self.q_norm = nn.LayerNorm(self.head_dim, eps=config.norm_eps)
            self.k_norm = nn.LayerNorm(self.head_dim, eps=config.norm_eps)
        else:
            self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.logits_tap = AttentionLogitsTap(self.scale)
        if config.norm_placement == "deepnorm":  # DeepNet's beta for the value rows of qkv and for out_proj
            beta = deepnorm_beta(config.num_hidden_layers)
            self.qkv.value_init_gain = self.out_proj.init_gain = beta  # read by _init_weights

    def forward(self, x, layout: TokenLayout, output_attentions: bool = False):
        """-> (output in x's layout, attention weights (B, H, L, L) if output_attentions else None)."""
        qkv = layout.unpack(self.qkv(x))  # (B, L, 3D): attention needs the (B, L) grid, even when packed
        B, L, _ = qkv.shape
        qkv = qkv.view(B, L, 3, self.num_heads, self.head_dim)  # (B, L, 3, H, Dh)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, L, Dh)
        q, k = self.logits_tap(query=self.q_norm(q), key=self.k_norm(k), layout=layout)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        if output_attentions:
            attention = eager_attention_forward  # the only one that returns the weights
        dropout_p = self.attn_dropout.p if self.training else 0.0
        y, weights = attention(self, q, k, v, layout.attn_bias, dropout=dropout_p, scaling=self.scale)  # (B, L, H, Dh)
        y = y.reshape(B, L, -1)  # (B, L, D): heads side by side again (pad keys got weight exactly 0 in every path)
        out = self.out_proj(layout.pack(y))  # back to x's layout before the projection: pads cost nothing
        return out, (weights if output_attentions else None)


class NormLabFeedForward(nn.Module):
    """Position-wise MLP: D -> I -> D with the configured activation."""

    def __init__(self, config: NormLabConfig):
        super().__init__()
        self.fc_in = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.fc_out = nn.Linear(config.intermediate_size, config.hidden_size)
        if config.norm_placement == "deepnorm":  # DeepNet's beta applies to both ffn projections
            self.fc_in.init_gain = self.fc_out.init_gain = deepnorm_beta(config.num_hidden_layers)

    def forward(self, x):
        return self.fc_out(self.act(self.fc_in(x)))  # (B, L, D)


class NormLabBlock(GradientCheckpointingLayer):
    """One encoder layer; `config.norm_placement` decides where its norms sit.

    post      x = norm(x + f(x))                          BERT (Devlin et al. 2019)
    pre       x = x + f(norm(x))                          GPT-2 / Megatron; the encoder adds a final norm
    sandwich  x = x + norm_out(f(norm_in(x)))             Peri-LN (Kim et al. 2025); final norm too
    deepnorm  x = norm(alpha * x + f(x)), alpha=(2N)^1/4  DeepNet (Wang et al. 2022), post-LN that trains deep

    f is attention, then feed-forward, each with its own norm(s) and residual dropout last.
    forward: x (B, L, D) or packed (1, T, D) -> (x, attention weights or None).
    """

    def __init__(self, config: NormLabConfig):
        super().__init__()
        self.placement = config.norm_placement
        self.attention = NormLabAttention(config)
        self.ffn = NormLabFeedForward(config)
        self.attn_norm = build_norm(config)  # post/deepnorm: after the residual add; pre/sandwich: branch input
        self.ffn_norm = build_norm(config)
        if self.placement == "sandwich":
            self.attn_out_norm = build_norm(config)  # normalizes the branch output before it joins the stream
            self.ffn_out_norm = build_norm(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.residual_scale = deepnorm_alpha(config.num_hidden_layers) if self.placement == "deepnorm" else 1.0
        self.output_tap = Tap()

    def forward(self, x, layout: TokenLayout, output_attentions: bool = False):
        drop, mask = self.dropout, layout.norm_mask
        if self.placement == "pre":
            attn, weights = self.attention(self.attn_norm(x, mask), layout, output_attentions)
            x = x + drop(attn)
            x = x + drop(self.ffn(self.ffn_norm(x, mask)))
        elif self.placement == "sandwich":
            attn, weights = self.attention(self.attn_norm(x, mask), layout, output_attentions)
            x = x + drop(self.attn_out_norm(attn, mask))
            x = x + drop(self.ffn_out_norm(self.ffn(self.ffn_norm(x, mask)), mask))
        else:  # post and deepnorm: one code path, deepnorm only up-weights the residual
            a = self.residual_scale
            residual = x if a == 1.0 else x * a
            attn, weights = self.attention(x, layout, output_attentions)
            x = self.attn_norm(residual + drop(attn), mask)
            x = self.ffn_norm((x if a == 1.0 else x * a) + drop(self.ffn(x)), mask)
        return self.output_tap(x, layout=layout), weights


class NormLabEncoder(nn.Module):
    """The stack of blocks (+ a final norm for the placements that leave the residual stream unnormalized). The final
    norm is the last thing the classifier's input passes through, so its type (`config.final_norm`, by default the
    blocks') may be set on its own: what it does to the pooled vectors can then be told apart from the blocks'."""

    def __init__(self, config: NormLabConfig):
        super().__init__()
        self.layers = nn.ModuleList([NormLabBlock(config) for _ in range(config.num_hidden_layers)])
        has_final = config.norm_placement in PLACEMENTS_WITH_FINAL_NORM
        self.final_norm = build_norm(config, norm=config.final_norm) if has_final else None

    def forward(self, x, layout: TokenLayout, output_hidden_states=False, output_attentions=False):
        """x (B, L, D) or packed (1, T, D) -> last_hidden_state (B, L, D), hidden_states (the input of every block,
        then last_hidden_state; each the tensor the next block reads, so autograd.grad works on it), attentions."""
        hidden_states = () if output_hidden_states else None
        attentions = () if output_attentions else None
        x = layout.clear_pads(x)
        for layer in self.layers:
            if output_hidden_states:
                h = layout.unpack(x)  # (B, L, D)
                hidden_states += (h,)
                x = layout.pack(h)
            x, weights = layer(x, layout, output_attentions)
            x = layout.clear_pads(x)  # padded layout: the next block reads zeros at pads, as in the packed one
            if output_attentions:
                attentions += (weights,)
        if self.final_norm is not None:
            x = self.final_norm(x, layout.norm_mask)
        last = layout.unpack(x)  # (B, L, D)
        if output_hidden_states:
            hidden_states += (last,)
        return last, hidden_states, attentions


class NormLabPreTrainedModel(PreTrainedModel):
    config_class = NormLabConfig
    config: NormLabConfig
    base_model_prefix = "normlab"
    supports_gradient_checkpointing = True  # NormLabBlock is a GradientCheckpointingLayer
    _supports_sdpa = True  # the default attention then is "sdpa"; "eager" and any registered function work too
    _no_split_modules = ["NormLabEmbeddings", "NormLabBlock"]
    # The heads return a per-batch mean loss: the Trainer must divide it by the gradient-accumulation steps itself.
    accepts_loss_kwargs = False

    # Every Auto class a checkpoint opens with (`register_for_auto_class` records only the class being saved).
    _auto_map = {
        "AutoConfig": "configuration_normlab.NormLabConfig",
        "AutoModel": "modeling_normlab.NormLabModel",
        "AutoModelForSequenceClassification": "modeling_normlab.NormLabForSequenceClassification",
        "AutoModelForMaskedLM": "modeling_normlab.NormLabForMaskedLM",
    }

    def _init_weights(self, module):
        """Linear/Embedding ~ N(0, initializer_range) (padding row zero), norms at identity, DeepNet gains. Only
        `transformers.initialization` functions: they skip tensors loaded from a checkpoint."""
        super()._init_weights(module)  # Linear, Embedding, *LayerNorm*/*RMSNorm*-named modules
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            if hasattr(module, "init_gain"):  # DeepNet's beta (ffn and output projections)
                init.normal_(module.weight, 0.0, std * module.init_gain)
            if hasattr(module, "value_init_gain"):  # fused qkv under DeepNet: only the value rows get beta
                w = module.weight
                if not getattr(w, "_is_hf_initialized", False):  # a slice loses the "loaded" flag: check here
                    with torch.no_grad():
                        w[2 * (w.shape[0] // 3) :].normal_(0.0, std * module.value_init_gain)
        elif isinstance(module, Norm):
            _init_norm(module)

    def batch_statistics_norms(self) -> dict[str, nn.Module]:
        """{qualified name: norm} of the norms that normalize with batch statistics (the classes that declare
        `batch_stats` in norms.py), in module order; empty for per-token norms. A method, so that it reaches a
        trust_remote_code model's own norm classes."""
        return batch_statistics_norms(self)

    @classmethod
    def builds_batch_statistics(cls, config: NormLabConfig) -> bool:
        """Whether this model built from `config` has a module that normalizes with batch statistics: a block's
        norm, the final norm, the pooled-vector centring, whatever the config adds. Asked of the modules themselves
        (`batch_statistics_norms`), built on the meta device (no memory, no init values), where there is a config
        but no weights to load (the study deciding how to score a run)."""
        with torch.device("meta"):
            return bool(cls(config).batch_statistics_norms())

    def taps(self) -> dict[str, nn.Module]:
        """The points of the forward a probe observes, by name, for each encoder block i in order:
            layers.{i}                   the block itself: its parameters and norms are measured per block
            layers.{i}.attention_logits  its attention's AttentionLogitsTap (queries, keys after QK-norm, scale)
            layers.{i}.output            a Tap on the block's output, the residual stream in the layout's shape
        What a hook on a tap receives is the tap's contract (`Tap`, `AttentionLogitsTap`), not the modules'."""
        taps = {}
        for i, block in enumerate(self.base_model.encoder.layers):
            taps[f"layers.{i}"] = block
            taps[f"layers.{i}.attention_logits"] = block.attention.logits_tap
            taps[f"layers.{i}.output"] = block.output_tap
        return taps

    def batch_stats_in_eval(self, flag: bool = True) -> int:
        """In eval, normalize each batch with its own statistics (True) or the running ones (False, the default) in
        every batch-statistics norm; returns how many were switched. A method, so it reaches a trust_remote_code
        model's own norm classes."""
        return set_batch_stats_in_eval(self, flag)

    def fill_auto_map(self) -> None:
        """config.auto_map names every Auto class, so a saved directory opens with each of them."""
        if self._auto_class is not None:
            self.config.auto_map = {**self._auto_map, **(getattr(self.config, "auto_map", None) or {})}

    def save_pretrained(self, save_directory, *args, **kwargs):
        self.fill_auto_map()
        return super().save_pretrained(save_directory, *args, **kwargs)


def _init_norm(module: nn.Module) -> None:
    """Reset a norm from norms.py to the values its class declares (`Norm.initial_values`): scale 1, shift 0,
    running statistics at their neutral values, DyT's alpha at its configured start."""
    values = module.initial_values()
    for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
        init.constant_(t, values[name])  # a KeyError here: the norm class forgot to declare this tensor's start


def _padding_mask(attention_mask):
    """HF attention_mask (B, L) of 0/1 -> bool padding mask, or None when nothing is padded (fast path)."""
    if attention_mask is None:
        return None
    mask = attention_mask.bool()
    if torch.compiler.is_compiling():  # a data-dependent branch would break the graph; the mask is exact anyway
        return mask
    return None if bool(mask.all()) else mask


class NormLabModel(NormLabPreTrainedModel):
    """The bare encoder: embeddings + blocks. Returns `BaseModelOutput`."""

    def __init__(self, config: NormLabConfig):
        super().__init__(config)
        self.embeddings = NormLabEmbeddings(config)
        self.encoder = NormLabEncoder(config)
        # Run only the real tokens of a padded batch (TokenLayout): speed, not the function computed, so no config field
        self.unpad = True
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                output_attentions=None, output_hidden_states=None):
        """input_ids (B, L), or inputs_embeds (B, L, D) in their place. Returns `BaseModelOutput`: last_hidden_state
        (B, L, D) with zeros at pad positions, hidden_states / attentions when asked (see NormLabEncoder)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("NormLabModel.forward needs exactly one of input_ids (B, L) and inputs_embeds (B, L, D)")
        c = self.config
        output_attentions = output_attentions if output_attentions is not None else c.output_attentions
        output_hidden_states = output_hidden_states if output_hidden_states is not None else c.output_hidden_states
        mask = _padding_mask(attention_mask)  # (B, L) bool or None
        batch_size = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        packed = (
            self.unpad
            # the naive BN must see the padding: that is its point
            and not any(NORM_REGISTRY[n].sees_padding for n in c.norms_used())
            # ghost batches: a norm finds each token's sentence, hence its group, as its row of the (B, L) grid
            and ghost_groups(batch_size, c.bn_group_size) == 1
            and not torch.compiler.is_compiling()  # packing has data-dependent shapes
        )
        layout = TokenLayout(mask, packed, attention_dtype(self.embeddings.word_embeddings.weight))
        x = self.embeddings(input_ids, layout, token_type_ids, position_ids, inputs_embeds)  # (B, L, D) or (1, T, D)
        x, hidden_states, attentions = self.encoder(x, layout, output_hidden_states, output_attentions)
        return BaseModelOutput(last_hidden_state=x, hidden_states=hidden_states, attentions=attentions)


def pool_tokens(x, attention_mask, pooling):
    """(B, L, D) -> (B, D): the first token ([CLS]) or the mean over real tokens."""
    if pooling == "cls":
        return x[:, 0]
    if attention_mask is None:
        return x.mean(dim=1)
    m = attention_mask.to(x.dtype).unsqueeze(-1)  # (B, L, 1)
    return (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)


class NormLabForSequenceClassification(NormLabPreTrainedModel):
    """Encoder -> pool (CLS or mean over real tokens) -> [batch centring or standardization] -> [fixed gain] ->
    dropout -> linear. No BERT pooler: an un-normalized layer that would blur the comparison of norms
    (docs/model.md). The optional step (`config.pooled_norm`) subtracts the batch's mean pooled vector (what batch
    statistics remove that all sentences share), or standardizes each feature over the batch; `config.pooled_gain`
    scales the result by a fixed factor, to tell a larger input from a batch-adaptive one."""

    def __init__(self, config: NormLabConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.normlab = NormLabModel(config)
        p = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        # One of the two at most (config.pooled_norm); `center` keeps the name that saved checkpoints use.
        stats = dict(eps=config.norm_eps, momentum=config.bn_momentum, group_size=config.bn_group_size)
        self.center = BatchCentering(config.hidden_size, **stats) if config.pooled_norm == "center" else None
        self.standardize = (BatchStandardization(config.hidden_size, **stats)
                            if config.pooled_norm == "standardize" else None)
        self.dropout = nn.Dropout(p)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, output_attentions=None, output_hidden_states=None):
        out = self.normlab(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                           output_attentions, output_hidden_states, return_dict=True)
        pooled = pool_tokens(out.last_hidden_state, attention_mask, self.config.pooling)  # (B, D)
        if self.center is not None:
            pooled = self.center(pooled)  # (B, D), each feature's batch mean removed
        if self.standardize is not None:
            pooled = self.standardize(pooled)  # (B, D), each feature at batch mean 0 and variance 1
        if self.config.pooled_gain != 1:
            pooled = pooled * self.config.pooled_gain  # a fixed scale: not measured on the batch, not learned
        logits = self.classifier(self.dropout(pooled))  # (B, num_labels)
        # transformers' problem_type logic (inferred once from num_labels and the labels' dtype): MSE / CE / BCE
        loss = None if labels is None else self.loss_function(labels, logits, self.config)
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                        attentions=out.attentions)


class NormLabLMHead(nn.Module):
    """BERT's MLM head: dense -> act -> norm -> decoder tied to the word embeddings, with its own bias. The norm is
    the configured one, so `norm=none` really is norm-free and BN variants see only real tokens."""

    def __init__(self, config: NormLabConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]
        self.norm = build_norm(config)
        # weight tied to the word embeddings (see _tied_weights_keys); the bias is the head's own
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, x, mask=None):  # (B, L, D) -> (B, L, V)
        return self.decoder(self.norm(self.act(self.dense(x)), mask))


class NormLabForMaskedLM(NormLabPreTrainedModel):
    """Encoder -> MLM head; loss is cross-entropy over positions whose label is not -100."""

    _tied_weights_keys = {"lm_head.decoder.weight": "normlab.embeddings.word_embeddings.weight"}

    def __init__(self, config: NormLabConfig):
        super().__init__(config)
        self.normlab = NormLabModel(config)
        self.lm_head = NormLabLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, output_attentions=None, output_hidden_states=None):
        out = self.normlab(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                           output_attentions, output_hidden_states, return_dict=True)
        logits = self.lm_head(out.last_hidden_state, _padding_mask(attention_mask))  # (B, L, V)
        loss = None
        if labels is not None:
            loss = CrossEntropyLoss(ignore_index=-100)(logits.view(-1, logits.size(-1)), labels.view(-1))
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)


__all__ = [
    "Tap", "AttentionLogitsTap", "NormLabEmbeddings", "NormLabAttention", "NormLabFeedForward", "NormLabBlock",
    "NormLabEncoder", "NormLabPreTrainedModel", "NormLabModel", "NormLabForSequenceClassification",
    "NormLabForMaskedLM", "deepnorm_alpha", "deepnorm_beta",
]
