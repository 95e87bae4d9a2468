"""Hugging Face BERT / MegatronBERT -> NormLab, weight for weight.

Two jobs: start NormLab runs from BERT weights, and pin our post-LN and pre-LN blocks to someone else's code
(tests/test_convert.py checks the hidden states agree to 1e-5).

BERT (post-LN, LayerNorm on the embeddings) and MegatronBERT (pre-LN, no embedding norm, a final LayerNorm
`encoder.ln`) are the same network up to where the norms sit, so one mapping serves both; only the names of the
norms differ. q, k and v are concatenated row-wise into NormLab's fused `qkv` ([query; key; value]).
"""

import torch

from .configuration_normlab import NormLabConfig
from .modeling_normlab import NormLabModel

# The config fields BERT and MegatronBERT share with NormLabConfig, name for name.
SHARED_CONFIG_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                        "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
                        "type_vocab_size", "initializer_range", "pad_token_id")


def _base(hf_model, expected: str):
    """BertModel from BertModel or any BertFor* (which keeps it at `.bert`); same for MegatronBERT."""
    base = getattr(hf_model, "bert", hf_model)
    if type(base).__name__ != expected:
        raise ValueError(f"expected a {expected} or a model holding one at `.bert`, got {type(hf_model).__name__}")
    return base


def _config_from(hf_config, placement: str, embedding_norm: bool) -> NormLabConfig:
    if getattr(hf_config, "position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"position_embedding_type={hf_config.position_embedding_type!r} is not supported; NormLab has only "
            "'absolute' (learned) positions"
        )
    shared = {name: getattr(hf_config, name) for name in SHARED_CONFIG_FIELDS}
    return NormLabConfig(**shared, norm="layernorm", norm_placement=placement, norm_eps=hf_config.layer_norm_eps,
                         embedding_norm=embedding_norm)


def _copy(dst: torch.nn.Module, src: torch.nn.Module):
    dst.weight.copy_(src.weight)
    if getattr(src, "bias", None) is not None:
        dst.bias.copy_(src.bias)


def _copy_attention(dst, self_attention, output_dense):
    """Three (D, D) projections -> one fused (3D, D) projection; then the output projection."""
    q, k, v = self_attention.query, self_attention.key, self_attention.value
    dst.qkv.weight.copy_(torch.cat([q.weight, k.weight, v.weight], dim=0))
    dst.qkv.bias.copy_(torch.cat([q.bias, k.bias, v.bias], dim=0))
    _copy(dst.out_proj, output_dense)


def _copy_embeddings(dst, src):
    _copy(dst.word_embeddings, src.word_embeddings)
    _copy(dst.position_embeddings, src.position_embeddings)
    _copy(dst.token_type_embeddings, src.token_type_embeddings)


@torch.no_grad()
def bert_to_normlab(hf_model) -> NormLabModel:
    """HF `BertModel` (or `BertFor*`) -> NormLab encoder: post-LN, LayerNorm on the embeddings, BERT's eps.

    BERT's pooler and task heads are not copied (NormLab classifies from the pooled hidden state directly).
    Returns a `NormLabModel` in eval mode.
    """
    bert = _base(hf_model, "BertModel")
    model = NormLabModel(_config_from(bert.config, "post", embedding_norm=True))
    _copy_embeddings(model.embeddings, bert.embeddings)
    _copy(model.embeddings.norm, bert.embeddings.LayerNorm)
    for block, layer in zip(model.encoder.layers, bert.encoder.layer):
        _copy_attention(block.attention, layer.attention.self, layer.attention.output.dense)
        _copy(block.attn_norm, layer.attention.output.LayerNorm)  # norm(x + attention(x))
        _copy(block.ffn.fc_in, layer.intermediate.dense)
        _copy(block.ffn.fc_out, layer.output.dense)
        _copy(block.ffn_norm, layer.output.LayerNorm)  # norm(x + ffn(x))
    return model.eval()


@torch.no_grad()
def megatron_bert_to_normlab(hf_model) -> NormLabModel:
    """HF `MegatronBertModel` (or `MegatronBertFor*`) -> NormLab encoder: pre-LN, no embedding norm, final norm.

    Returns a `NormLabModel` in eval mode.
    """
    bert = _base(hf_model, "MegatronBertModel")
    model = NormLabModel(_config_from(bert.config, "pre", embedding_norm=False))
    _copy_embeddings(model.embeddings, bert.embeddings)
    for block, layer in zip(model.encoder.layers, bert.encoder.layer):
        _copy(block.attn_norm, layer.attention.ln)  # x + attention(ln(x))
        _copy_attention(block.attention, layer.attention.self, layer.attention.output.dense)
        _copy(block.ffn_norm, layer.ln)  # x + ffn(ln(x))
        _copy(block.ffn.fc_in, layer.intermediate.dense)
        _copy(block.ffn.fc_out, layer.output.dense)
    _copy(model.encoder.final_norm, bert.encoder.ln)
    return model.eval()


__all__ = ["bert_to_normlab", "megatron_bert_to_normlab"]
