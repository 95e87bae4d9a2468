"""NormLab as a Hugging Face citizen: save/load round trips, Auto classes, remote code, pipelines. All offline."""

import json
import os
import subprocess
import sys
import textwrap

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing here needs the Hub

import pytest
import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    pipeline,
)

from model import NormLabConfig, NormLabForMaskedLM, NormLabForSequenceClassification, NormLabModel

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # [PAD] = 0 = NormLabConfig.pad_token_id
CORPUS = ["the cat sat on the mat", "a dog is a good dog", "the movie was great fun",
          "a terrible and boring film", "what a wonderful day", "the plot made no sense"]


def tiny_tokenizer():
    """A WordPiece tokenizer trained on a few sentences, BERT-style ([CLS] ... [SEP], lowercasing)."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=80, special_tokens=SPECIALS))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")
    assert fast.pad_token_id == 0
    return fast


def tiny_config(tokenizer, **overrides):
    kw = dict(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, num_labels=2, id2label={0: "negative", 1: "positive"},
        label2id={"negative": 0, "positive": 1}, pad_token_id=tokenizer.pad_token_id,
    )
    kw.update(overrides)
    return NormLabConfig(**kw)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Trained-looking checkpoints (classifier with masked BatchNorm running statistics, and an MLM) + tokenizer."""
    root = tmp_path_factory.mktemp("ckpt")
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    clf = NormLabForSequenceClassification(tiny_config(tokenizer, norm="masked_batchnorm", norm_placement="pre"))
    batch = tokenizer(CORPUS, padding=True, return_tensors="pt")
    clf.train()
    for _ in range(3):  # move the running statistics away from their (0, 1) start so saving them matters
        clf(**batch)
    clf.eval()
    mlm = NormLabForMaskedLM(tiny_config(tokenizer, norm="layernorm", norm_placement="post")).eval()
    paths = {"clf_dir": root / "clf", "mlm_dir": root / "mlm"}
    for name, model in (("clf", clf), ("mlm", mlm)):
        model.save_pretrained(paths[f"{name}_dir"])
        tokenizer.save_pretrained(paths[f"{name}_dir"])
    return dict(root=root, tokenizer=tokenizer, clf=clf, mlm=mlm, batch=batch, **paths)


def test_checkpoint_files_and_auto_map(saved):
    files = set(os.listdir(saved["clf_dir"]))
    assert {"config.json", "model.safetensors", "configuration_normlab.py", "modeling_normlab.py",
            "token_layout.py", "norms.py", "base_norm.py", "batch_norms.py", "powernorm.py", "ops.py",
            "layer_norm_op.py", "tokenizer.json"} <= files
    config = json.loads((saved["clf_dir"] / "config.json").read_text())
    assert config["model_type"] == "normlab"
    assert config["auto_map"] == {
        "AutoConfig": "configuration_normlab.NormLabConfig",
        "AutoModel": "modeling_normlab.NormLabModel",
        "AutoModelForSequenceClassification": "modeling_normlab.NormLabForSequenceClassification",
        "AutoModelForMaskedLM": "modeling_normlab.NormLabForMaskedLM",
    }
    # the copied code imports its siblings relatively, nothing from the project
    for name in ("configuration_normlab.py", "modeling_normlab.py", "token_layout.py", "norms.py", "base_norm.py",
                 "batch_norms.py", "powernorm.py", "ops.py", "layer_norm_op.py"):
        code = (saved["clf_dir"] / name).read_text()
        assert "from model" not in code and "import common" not in code and "from common" not in code


def test_save_load_round_trip_classifier(saved):
    loaded = NormLabForSequenceClassification.from_pretrained(saved["clf_dir"]).eval()
    assert not loaded.training
    for (name, a), b in zip(saved["clf"].state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        torch.testing.assert_close(loaded(**saved["batch"]).logits, saved["clf"](**saved["batch"]).logits,
                                   atol=0, rtol=0)
    assert loaded.config.embedding_norm is False and loaded.config.norm == "masked_batchnorm"


def test_save_load_round_trip_masked_lm_keeps_weights_tied(saved):
    loaded = NormLabForMaskedLM.from_pretrained(saved["mlm_dir"]).eval()
    assert loaded.lm_head.decoder.weight is loaded.normlab.embeddings.word_embeddings.weight
    with torch.no_grad():
        torch.testing.assert_close(loaded(**saved["batch"]).logits, saved["mlm"](**saved["batch"]).logits,
                                   atol=0, rtol=0)


def test_auto_classes(saved):
    config = AutoConfig.from_pretrained(saved["clf_dir"])
    assert isinstance(config, NormLabConfig)
    assert isinstance(AutoConfig.for_model("normlab", hidden_size=64, num_attention_heads=4), NormLabConfig)
    assert type(AutoModel.from_config(config)) is NormLabModel
    assert type(AutoModelForSequenceClassification.from_config(config)) is NormLabForSequenceClassification
    assert type(AutoModelForMaskedLM.from_config(config)) is NormLabForMaskedLM

    clf = AutoModelForSequenceClassification.from_pretrained(saved["clf_dir"]).eval()
    assert type(clf) is NormLabForSequenceClassification
    with torch.no_grad():
        torch.testing.assert_close(clf(**saved["batch"]).logits, saved["clf"](**saved["batch"]).logits)
    base = AutoModel.from_pretrained(saved["clf_dir"]).eval()  # the encoder out of a classifier checkpoint
    assert type(base) is NormLabModel
    with torch.no_grad():
        torch.testing.assert_close(base(**saved["batch"]).last_hidden_state,
                                   saved["clf"].normlab(**saved["batch"]).last_hidden_state)
    assert type(AutoModelForMaskedLM.from_pretrained(saved["mlm_dir"])) is NormLabForMaskedLM


REMOTE_SCRIPT = textwrap.dedent("""
    import sys, torch
    # an editable install of this checkout (requirements-dev.txt) makes it importable everywhere; a user's
    # fresh environment has no such finder
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
    try:
        import model  # noqa: F401 - the test is whether it imports
    except ModuleNotFoundError:
        pass
    else:
        sys.exit("the project is importable here; this test must run where it is not")
    from transformers import AutoModel, AutoModelForSequenceClassification
    ckpt, inputs_path, out_path = sys.argv[1:4]
    inputs = torch.load(inputs_path)
    clf = AutoModelForSequenceClassification.from_pretrained(ckpt, trust_remote_code=True).eval()
    base = AutoModel.from_pretrained(ckpt, trust_remote_code=True).eval()
    with torch.no_grad():
        result = {"logits": clf(**inputs).logits, "hidden": base(**inputs).last_hidden_state,
                  "module": type(clf).__module__, "base": type(base).__name__}
    # the tokenizer needs no custom code: the plain class loads it; AutoTokenizer reads config.json first
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    result["ids"] = [tok("the cat sat")["input_ids"] for tok in (
        PreTrainedTokenizerFast.from_pretrained(ckpt), AutoTokenizer.from_pretrained(ckpt, trust_remote_code=True))]
    torch.save(result, out_path)
""")


def _load_in_a_fresh_process(ckpt, inputs, tmp_path):
    """REMOTE_SCRIPT's results for checkpoint `ckpt` and `inputs`, from a process that cannot import the project."""
    torch.save(inputs, tmp_path / "inputs.pt")
    (tmp_path / "load.py").write_text(REMOTE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "hf_modules"),
               OMP_NUM_THREADS=str(torch.get_num_threads()))  # this process's thread count, as a user's would be
    proc = subprocess.run(
        [sys.executable, "load.py", str(ckpt), "inputs.pt", "out.pt"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "custom code" not in proc.stdout + proc.stderr and "model of type" not in proc.stderr  # no prompt
    return torch.load(tmp_path / "out.pt")


def test_trust_remote_code_in_a_fresh_process_without_the_project(saved, tmp_path):
    inputs = {k: v for k, v in saved["batch"].items()}
    result = _load_in_a_fresh_process(saved["clf_dir"], inputs, tmp_path)
    assert result["ids"] == [saved["tokenizer"]("the cat sat")["input_ids"]] * 2
    assert result["module"].startswith("transformers_modules"), result["module"]  # the checkpoint's own code
    assert result["base"] == "NormLabModel"
    with torch.no_grad():  # to float32 rounding: two processes need not sum in one order
        torch.testing.assert_close(result["logits"], saved["clf"](**inputs).logits)
        torch.testing.assert_close(result["hidden"], saved["clf"].normlab(**inputs).last_hidden_state)


BATCH_STATS_SCRIPT = textwrap.dedent("""
    import sys, torch
    from transformers import AutoModelForSequenceClassification
    ckpt, inputs_path, out_path = sys.argv[1:4]
    inputs = torch.load(inputs_path)
    clf = AutoModelForSequenceClassification.from_pretrained(ckpt, trust_remote_code=True).eval()
    flags = lambda: [m.use_batch_stats_in_eval for m in clf.batch_statistics_norms().values()]
    result = {"module": type(clf).__module__, "norms": list(clf.batch_statistics_norms())}
    with torch.no_grad():
        result["switched_on"], result["flags_on"] = clf.batch_stats_in_eval(True), flags()
        result["batch"] = clf(**inputs).logits
        result["switched_off"], result["flags_off"] = clf.batch_stats_in_eval(False), flags()
        result["running"] = clf(**inputs).logits
    torch.save(result, out_path)
""")


def test_batch_stats_in_eval_on_remote_code_as_on_the_class(saved, tmp_path):
    """The switch is a model method, so it travels with the checkpoint's code: a classifier loaded with
    trust_remote_code where the project is not importable (its norms are the checkpoint's classes, not
    model.norms') switches its BN layers and changes a padded batch's outputs as the imported class does (to
    rounding)."""
    inputs = dict(saved["batch"])
    assert not inputs["attention_mask"].bool().all()  # padded
    torch.save(inputs, tmp_path / "inputs.pt")
    (tmp_path / "load.py").write_text(BATCH_STATS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "hf_modules"),
               OMP_NUM_THREADS=str(torch.get_num_threads()))  # this process's thread count
    proc = subprocess.run([sys.executable, "load.py", str(saved["clf_dir"]), "inputs.pt", "out.pt"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    remote = torch.load(tmp_path / "out.pt")
    assert remote["module"].startswith("transformers_modules"), remote["module"]
    assert remote["switched_on"] == remote["switched_off"] == 5  # two per block and the final norm
    assert remote["flags_on"] == [True] * 5 and remote["flags_off"] == [False] * 5

    local = NormLabForSequenceClassification.from_pretrained(saved["clf_dir"]).eval()
    assert remote["norms"] == list(local.batch_statistics_norms())  # the method travels with the checkpoint too
    with torch.no_grad():
        running = local(**inputs).logits
        assert local.batch_stats_in_eval(True) == 5
        batch = local(**inputs).logits
        local.batch_stats_in_eval(False)
        torch.testing.assert_close(local(**inputs).logits, running, atol=0, rtol=0)  # switched back
    assert not torch.allclose(batch, running, atol=1e-4)  # the batch's statistics are not the running ones
    # to float32 rounding across processes, far below the 1e-4 the switch moves these logits by (asserted above)
    torch.testing.assert_close(remote["batch"], batch)
    torch.testing.assert_close(remote["running"], running)


def test_a_custom_layernorm_checkpoint_defines_its_operator(tmp_path):
    """CustomLayerNorm runs the operator normlab::layer_norm: a checkpoint's own code (layer_norm_op.py and ops.py,
    copied with it) defines it where the project is not importable, and gives the saved model's logits."""
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    clf = NormLabForSequenceClassification(tiny_config(tokenizer, norm="custom_layernorm")).eval()
    ckpt = tmp_path / "ckpt"
    clf.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    inputs = dict(tokenizer(CORPUS, padding=True, return_tensors="pt"))
    result = _load_in_a_fresh_process(ckpt, inputs, tmp_path)
    assert result["module"].startswith("transformers_modules"), result["module"]
    with torch.no_grad():  # (to rounding: this process may run the C++ kernel, the fresh one runs the reference)
        torch.testing.assert_close(result["logits"], clf(**inputs).logits)


def test_text_classification_pipeline(saved):
    classifier = pipeline("text-classification", model=str(saved["clf_dir"]), device="cpu")
    text = "the movie was great fun"
    results = classifier([text, "a boring film"], top_k=None)
    assert len(results) == 2
    scores = {r["label"]: r["score"] for r in results[0]}
    assert set(scores) == {"negative", "positive"}
    enc = saved["tokenizer"](text, return_tensors="pt")
    with torch.no_grad():
        probs = saved["clf"](**enc).logits.softmax(-1)[0]
    assert scores["negative"] == pytest.approx(probs[0].item(), abs=1e-5)
    assert scores["positive"] == pytest.approx(probs[1].item(), abs=1e-5)


def test_fill_mask_pipeline(saved):
    fill = pipeline("fill-mask", model=str(saved["mlm_dir"]), device="cpu")
    results = fill("the cat [MASK] on the mat", top_k=3)
    assert len(results) == 3
    tok = saved["tokenizer"]
    enc = tok("the cat [MASK] on the mat", return_tensors="pt")
    position = (enc["input_ids"][0] == tok.mask_token_id).nonzero().item()
    with torch.no_grad():
        probs = saved["mlm"](**enc).logits[0, position].softmax(-1)
    top = probs.topk(3)
    assert [r["token"] for r in results] == top.indices.tolist()
    for r, p in zip(results, top.values.tolist()):
        assert r["score"] == pytest.approx(p, abs=1e-5)
        assert "[MASK]" not in r["sequence"]


def test_tokenizer_round_trip(saved):
    tok = AutoTokenizer.from_pretrained(saved["clf_dir"])
    assert tok.pad_token_id == 0 and tok.mask_token == "[MASK]"
    assert tok("the cat")["input_ids"] == saved["tokenizer"]("the cat")["input_ids"]


@pytest.fixture
def fresh_accelerate_state():
    """transformers' Trainer and our loop each build an Accelerator; accelerate's state is a process singleton."""
    from accelerate.state import AcceleratorState, GradientState

    def reset():
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    reset()
    yield reset
    reset()


def test_trainer_with_gradient_accumulation_matches_our_training_loop(tmp_path, fresh_accelerate_state):
    """transformers' Trainer (gradient_accumulation_steps=2) and train.py's loop (accelerate's accumulate, backward,
    clipping, the same AdamW) on the same batches log the same losses and end with the same weights: the Trainer
    must divide our per-batch mean loss by the accumulation steps (it does not when a forward takes **kwargs)."""
    import copy

    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

    from normlab.config.loader import load_config
    from normlab.train.optim import adamw

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    model = NormLabForSequenceClassification(tiny_config(tokenizer, hidden_dropout_prob=0.0,
                                                         attention_probs_dropout_prob=0.0))
    ours = copy.deepcopy(model)
    features = [{**tokenizer(text), "labels": i % 2} for i, text in enumerate(CORPUS * 4)]  # 24 rows
    collate = DataCollatorWithPadding(tokenizer)
    hparams = load_config(overrides=["train.lr=3e-3", "train.weight_decay=0.01", "train.adam_beta1=0.9",
                                     "train.adam_beta2=0.98"]).train
    batch_size, accum, clip = 3, 2, 1.0

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=batch_size,
                             gradient_accumulation_steps=accum, num_train_epochs=1, max_grad_norm=clip,
                             lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, report_to="none",
                             save_strategy="no", use_cpu=True, train_sampling_strategy="sequential",
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=features, data_collator=collate,
                      optimizers=(adamw(model, hparams), None))
    assert trainer.model_accepts_loss_kwargs is False
    trainer.train()
    trainer_losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]

    fresh_accelerate_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum)
    optimizer = adamw(ours, hparams)
    ours, optimizer, loader = accelerator.prepare(ours, optimizer, DataLoader(features, batch_size=batch_size,
                                                                              collate_fn=collate))
    ours.train()
    our_losses, window = [], []
    for batch in loader:
        with accelerator.accumulate(ours):
            loss = ours(**batch).loss
            accelerator.backward(loss)
            window.append(loss.item())
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(ours.parameters(), clip)
                our_losses.append(sum(window) / len(window))
                window = []
            optimizer.step()
            optimizer.zero_grad()

    assert len(our_losses) == len(features) // (batch_size * accum) == len(trainer_losses)
    assert trainer_losses == pytest.approx(our_losses, rel=1e-4)  # the Trainer logs 4 significant digits
    for (name, a), b in zip(model.state_dict().items(), accelerator.unwrap_model(ours).state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
