"""The models sections 2 and 4 race: NormLab (the config's model) and an HF BERT of identical size, and the training
step each takes (train.py's)."""

from dataclasses import dataclass

import torch

from normlab.train.optim import adamw  # the optimizer train.py uses
from normlab.train.step import train_step  # the step train.py takes

# what the HF BERT takes from NormLab's config as it is (its norm's eps is named layer_norm_eps there)
SAME_SIZE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
             "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
             "initializer_range", "classifier_dropout")


@dataclass(frozen=True)
class TaskShape:
    """What a classifier takes from the data: the tokenizer's vocabulary and pad id, and the label count."""
    vocab_size: int
    pad_token_id: int
    num_labels: int


def build_models(cfg, task: TaskShape, seed: int):
    """NormLab (the default config's model) and an HF BERT of identical size; same seed for both."""
    from transformers import BertConfig, BertForSequenceClassification

    from model import NormLabForSequenceClassification
    from normlab.config.loader import model_config_from

    nl_config = model_config_from(cfg, vocab_size=task.vocab_size, pad_token_id=task.pad_token_id,
                                  num_labels=task.num_labels)
    torch.manual_seed(seed)
    normlab = NormLabForSequenceClassification(nl_config)
    hf_config = BertConfig(vocab_size=task.vocab_size, pad_token_id=task.pad_token_id, num_labels=task.num_labels,
                           layer_norm_eps=nl_config.norm_eps, **{key: getattr(nl_config, key) for key in SAME_SIZE})
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    hf = BertForSequenceClassification(hf_config)
    assert cfg.model.hidden_size == hf.config.hidden_size
    return normlab, hf


def _params(module) -> int:
    """The parameter count of `module`; 0 for None (a norm the model does not have)."""
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def param_counts(normlab, hf) -> dict:
    """Both models' parameter counts, and whether their difference is exactly what the explanation names."""
    n_nl, n_hf = _params(normlab), _params(hf)
    pooler, hf_emb_norm = _params(hf.bert.pooler), _params(hf.bert.embeddings.LayerNorm)
    nl_emb_norm, nl_final = _params(normlab.normlab.embeddings.norm), _params(normlab.normlab.encoder.final_norm)
    explained = n_hf - pooler - hf_emb_norm + nl_emb_norm + nl_final
    return {
        "normlab": n_nl, "hf_bert": n_hf, "difference_hf_minus_normlab": n_hf - n_nl,
        "explanation": (f"HF has BERT's pooler (dense D->D + tanh: {pooler} params) that NormLab's classifier "
                        f"omits; HF normalizes the embeddings ({hf_emb_norm}) where pre-LN NormLab has "
                        f"{'an embedding norm (' + str(nl_emb_norm) + ')' if nl_emb_norm else 'none'} and "
                        f"{'a final norm (' + str(nl_final) + ')' if nl_final else 'no final norm'}; every other "
                        f"tensor has the same shape"),
        "explained_exactly": explained == n_nl,
    }


def contestant_models(cfg, task: TaskShape, *, compile_normlab: bool = False, compile_hf: bool = False,
                      diagnose: bool = False, extras: bool = True) -> dict:
    """name -> model, all built from the same seed. `extras` False: only NormLab eager and HF BERT eager (no
    logging, compiled or diagnostic contestants)."""
    from normlab.config.loader import replace_keys

    def build(c=cfg):
        return build_models(c, task, cfg.seed)

    normlab, hf = build()
    models = {"normlab_eager": normlab, "hf_bert_eager": hf}
    if not extras:
        return models
    models["normlab_eager_logged"] = build()[0]  # with train.py's per-step stability logging: what it costs
    if compile_normlab:
        models["normlab_compiled"] = build()[0]
        models["normlab_compiled"].compile()  # as train.py does for train.compile=true
    if diagnose:
        # the same NormLab with torch.nn.LayerNorm: what CustomLayerNorm costs inside the model
        models["normlab_eager_torch_ln"] = build(replace_keys(cfg, {"model.norm": "layernorm"}))[0]
        models["normlab_eager_padded_layout"] = build()[0]  # without skipping pad positions
        models["normlab_eager_padded_layout"].normlab.unpad = False
        # and on the reference implementation of its operators (train.kernels=reference)
        models["normlab_eager_reference_kernels"] = build()[0]
    if compile_hf:
        models["hf_bert_compiled"] = build()[1]
        models["hf_bert_compiled"].compile()
    return models


def prepare(name: str, model, device):
    """The contestant `name` on `device` in training mode, with train.py's kernels (train.kernels=auto), or the
    reference ones for the *_reference_kernels contestant (its steps: on_reference_kernels)."""
    import normlab.kernels

    model.to(device).train()
    if name.startswith("normlab"):
        normlab.kernels.use(model, "reference" if name.endswith("reference_kernels") else "auto", device)
        normlab.kernels.enable("auto", device)  # what the other contestants' steps run on
    return model


def make_step(accelerator, model, train_cfg, logged: bool = False):
    """(step(batch), optimizer): one step of train.py's loop (normlab.train.step.train_step) with one micro-batch per
    optimizer step, on a fresh AdamW with a constant rate. `logged`: also the stability logging of a logging step
    (train.log_steps=1: every step), from the probe's measurements to the metrics row combined over processes."""
    from transformers import get_scheduler

    from normlab.train.probes import StabilityProbe

    optimizer = adamw(model, train_cfg)
    scheduler = get_scheduler("constant", optimizer)
    probe = StabilityProbe(model) if logged else None

    def step(batch):
        done = train_step(accelerator, model, optimizer, batch, train_cfg.max_grad_norm, probe=probe, log=logged)
        if logged:
            probe.collect(accelerator, done.grad_norm, optimizer.param_groups[0]["lr"])
        scheduler.step()
        return done.loss

    return step, optimizer


def on_reference_kernels(step, device):
    """The step with NormLab's operators on their reference implementation (re-registered around each step)."""
    import normlab.kernels

    def wrapped(batch):
        normlab.kernels.enable("reference", device)
        try:
            return step(batch)
        finally:
            normlab.kernels.enable("auto", device)

    return wrapped
