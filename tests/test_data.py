"""Data: finding the dataset (mirror, local files), clear errors on bad data, the tokenizer, and the batching."""

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from datasets import Dataset
from torch.utils.data import DataLoader

from normlab.config.loader import REPO_ROOT, load_config
from normlab.data.batching import (
    LengthGroupedBatchSampler,
    RandomBatchSampler,
    build_dataloaders,
    pad_fraction,
    pad_rows,
)
from normlab.data.sources import DataError, label_names, mirror_candidates, resolve_dataset
from normlab.data.tokenizer import get_tokenizer, tokenize_splits

MIRROR = REPO_ROOT.parent / "shared" / "datasets" / "sst2"
SMALL = ["data.max_train_samples=300", "data.max_eval_samples=60", "model.vocab_size=400"]
NAMED = "data.label_names=[negative,positive]"  # SST-2's rows in files of one's own: their names are given


@pytest.fixture(autouse=True)
def _offline_and_private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path_factory.getbasetemp() / "normlab_cache"))
    monkeypatch.delenv("NORMLAB_DATA_DIR", raising=False)


@pytest.fixture(scope="module")
def sst2_rows():
    """A few hundred rows of the shared SST-2 mirror, as DataFrames."""
    train = pd.read_parquet(MIRROR / "train.parquet").iloc[:300]
    validation = pd.read_parquet(MIRROR / "validation.parquet").iloc[:60]
    return train, validation


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(cfg, resolved splits, tokenizer, tokenized splits) on 300/60 rows of the mirror."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("NORMLAB_CACHE", str(tmp_path_factory.getbasetemp() / "normlab_cache"))  # as in every test
    cfg = load_config(overrides=SMALL)
    dsd = resolve(cfg)
    tok = get_tokenizer(cfg.data, cfg.model.vocab_size, col(dsd["train"], "sentence"))
    tokenized = tokenize_splits(dsd, tok, cfg.data, cfg.task)
    yield cfg, dsd, tok, tokenized
    mp.undo()


def write(df: pd.DataFrame, path, fmt: str):
    if fmt == "parquet":
        df.to_parquet(path, index=False)
    elif fmt == "csv":
        df.to_csv(path, index=False)
    elif fmt == "tsv":
        df.to_csv(path, index=False, sep="\t")
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in df.to_dict("records")))


def col(ds, name):
    """A dataset column as a list (`ds[name]` is a lazy Column in datasets >= 4)."""
    return ds.select_columns([name])[:][name]


def resolve(cfg):
    """The config's splits as train.py resolves them (labels checked for classification)."""
    return resolve_dataset(cfg.data, with_labels=cfg.task == "classification")


def cfg_with(*overrides):
    return load_config(overrides=list(overrides))


# ----------------------------------------------------------------------------------------------------------
# finding the data


def test_mirror_found_from_the_repo_location_whatever_the_cwd(small, tmp_path, monkeypatch):
    assert MIRROR in mirror_candidates("stanfordnlp/sst2")  # REPO_ROOT/../shared/datasets/<name tail>
    monkeypatch.chdir(tmp_path)
    cfg, dsd, _, _ = small
    assert set(dsd) == {"train", "validation"}
    assert (len(dsd["train"]), len(dsd["validation"])) == (300, 60)  # max_*_samples: the first N rows
    assert dsd["train"][0]["sentence"] == pd.read_parquet(MIRROR / "train.parquet").sentence[0]
    assert label_names(dsd, cfg.data) == ["negative", "positive"]  # data.label_names: the parquet files name none


def named_dataset(names, n=40):
    """A tiny datasets.Dataset that names its classes (a ClassLabel label column, as Hub datasets do)."""
    from datasets import ClassLabel, Dataset, Features, Value

    features = Features({"sentence": Value("string"), "label": ClassLabel(names=list(names))})
    return Dataset.from_dict({"sentence": [f"sentence number {i}" for i in range(n)],
                              "label": [i % len(names) for i in range(n)]}, features=features)


def unnamed_csv(path, n=40):
    """A csv of two classes (0, 1) that names neither."""
    write(pd.DataFrame({"sentence": [f"sentence number {i}" for i in range(n)], "label": [i % 2 for i in range(n)]}),
          path, "csv")
    return path


def test_class_names_are_the_settings_else_the_datasets_own(tmp_path):
    from datasets import DatasetDict

    csv = unnamed_csv(tmp_path / "mine.csv")
    assert label_names(resolve(cfg_with(f"data.path={csv}", "data.label_names=[bad,good]")), cfg_with().data) == [
        "bad", "good"]
    # a dataset that names its classes (a ClassLabel feature), saved to disk or as parquet: its own names
    named = named_dataset(["neg", "pos"])
    DatasetDict(train=named, validation=named).save_to_disk(tmp_path / "saved")
    (tmp_path / "pq").mkdir()
    named.to_parquet(tmp_path / "pq" / "train.parquet")
    named.to_parquet(tmp_path / "pq" / "validation.parquet")
    for folder in ("saved", "pq"):
        assert label_names(resolve(cfg_with(f"data.path={tmp_path / folder}")), cfg_with().data) == ["neg", "pos"]
    given = cfg_with(f"data.path={tmp_path / 'pq'}", "data.label_names=[bad,good]")  # a setting renames them
    assert label_names(resolve(given), cfg_with().data) == ["bad", "good"]


@pytest.mark.parametrize("variant,hub_names", [("imdb", ["neg", "pos"]),
                                                ("ag_news", ["World", "Sports", "Business", "Sci/Tech"])])
def test_hub_variants_keep_their_datasets_names_offline(tmp_path, monkeypatch, variant, hub_names):
    """configs/imdb.yaml and ag_news.yaml name the classes as their Hub datasets do; a local copy of the dataset
    (found by its name, as the Hub's would be) gives the same names with or without the variant's setting."""
    from datasets import DatasetDict

    cfg = load_config(variant)
    named = named_dataset(hub_names)
    DatasetDict({cfg.data.train_split: named, cfg.data.eval_split: named}).rename_column(
        "sentence", cfg.data.text_column).save_to_disk(tmp_path / cfg.data.name.split("/")[-1])
    monkeypatch.setenv("NORMLAB_DATA_DIR", str(tmp_path))
    assert cfg.data.label_names == hub_names
    assert label_names(resolve(cfg), cfg.data) == hub_names
    own = load_config(variant, ["data.label_names=null"])
    assert label_names(resolve(own), own.data) == hub_names
    bare = cfg_with(f"data.name={cfg.data.name}", f"data.text_column={cfg.data.text_column}",
                    f"data.eval_split={cfg.data.eval_split}")  # SST-2's default names do not follow it
    assert bare.data.label_names is None and label_names(resolve(bare), bare.data) == hub_names


def test_data_without_class_names_is_refused_in_one_line(tmp_path):
    csv = unnamed_csv(tmp_path / "mine.csv")
    for overrides in ([], ["data.label_names=null"]):
        with pytest.raises(DataError) as err:
            resolve(cfg_with(f"data.path={csv}", *overrides))
        assert str(err.value) == (f"data.label_names is required: {csv} has 2 classes (0, 1) and no class names; "
                                  f"set data.label_names=[neg,pos] (one per class, in label order)")
    wrong = {"data.label_names=[a,b,c]": "data.label_names=[a, b, c] gives 3 names but",
             "data.label_names=[a]": "data.label_names=[a] gives 1 names but",
             "data.label_names=[a,a]": "data.label_names=[a, a] names two classes 'a'; give 2 distinct names"}
    for override, words in wrong.items():
        with pytest.raises(DataError) as err:
            resolve(cfg_with(f"data.path={csv}", override))
        assert words in str(err.value) and "(one per class, in label order)" in str(err.value), str(err.value)
        assert "\n" not in str(err.value)
    named = named_dataset(["neg", "pos"])
    named.to_parquet(tmp_path / "train.parquet")
    named.to_parquet(tmp_path / "validation.parquet")
    with pytest.raises(DataError, match=r"data.num_labels=3 but .* names 2 classes \(neg, pos\); set data.num_labels"):
        resolve(cfg_with(f"data.path={tmp_path}", "data.num_labels=3"))


def test_train_refuses_unnamed_data_before_it_trains(tmp_path, capsys):
    from train_utils import run_here

    csv = unnamed_csv(tmp_path / "mine.csv")
    assert run_here(tmp_path / "run", f"data.path={csv}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: data.label_names is required: {csv} has 2 classes (0, 1) and no class names; set "
                   f"data.label_names=[neg,pos] (one per class, in label order)"]
    assert not (tmp_path / "run" / "config.yaml").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("source", ["csv with data.label_names", "parquet with ClassLabel names"])
def test_a_trained_model_names_its_classes_as_its_data(tmp_path, source):
    """config.json's id2label, the model card and a pipeline: the given names, or the dataset's own."""
    from transformers import pipeline

    from train_utils import run_here

    if source.startswith("csv"):
        data = [f"data.path={unnamed_csv(tmp_path / 'mine.csv', n=80)}", "data.label_names=[bad,good]"]
        names = ["bad", "good"]
    else:
        names = ["neg", "pos"]
        named_dataset(names, n=80).to_parquet(tmp_path / "mine.parquet")
        data = [f"data.path={tmp_path / 'mine.parquet'}"]
    out = tmp_path / "run"
    assert run_here(out, *data, "train.max_steps=2", "train.kernels=reference", "model.vocab_size=200") == 0
    assert json.loads((out / "final" / "config.json").read_text())["id2label"] == dict(zip("01", names))
    assert f"Labels: 0 = {names[0]}, 1 = {names[1]}." in (out / "final" / "README.md").read_text()
    classify = pipeline("text-classification", model=str(out / "final"), trust_remote_code=True, device="cpu")
    assert classify("sentence number 3")[0]["label"] in names


def test_normlab_data_dir_comes_before_the_shared_mirror(tmp_path, monkeypatch, sst2_rows):
    train, validation = sst2_rows
    (tmp_path / "sst2").mkdir()
    write(train.iloc[:40], tmp_path / "sst2" / "train.csv", "csv")
    write(validation.iloc[:10], tmp_path / "sst2" / "validation.csv", "csv")
    monkeypatch.setenv("NORMLAB_DATA_DIR", str(tmp_path))
    assert mirror_candidates("stanfordnlp/sst2")[0] == tmp_path / "sst2"
    dsd = resolve(cfg_with())
    assert (len(dsd["train"]), len(dsd["validation"])) == (40, 10)


@pytest.mark.parametrize("fmt", ["parquet", "tsv", "csv", "jsonl"])
def test_local_folder_in_every_format(tmp_path, sst2_rows, fmt):
    train, validation = sst2_rows
    train = train.iloc[:50].assign(sentence=lambda df: df.sentence + ", yes, with commas")  # tsv must keep them
    write(train, tmp_path / f"train.{fmt}", fmt)
    write(validation.iloc[:20], tmp_path / f"validation.{fmt}", fmt)
    dsd = resolve(cfg_with(f"data.path={tmp_path}", NAMED))
    assert (len(dsd["train"]), len(dsd["validation"])) == (50, 20)
    assert col(dsd["train"], "sentence") == list(train.sentence)
    assert col(dsd["train"], "label") == list(train.label)


def test_single_file_is_split_90_10_deterministically_and_dev_means_validation(tmp_path, sst2_rows):
    train, validation = sst2_rows
    write(train.iloc[:100], tmp_path / "all.jsonl", "jsonl")
    a = resolve(cfg_with(f"data.path={tmp_path / 'all.jsonl'}", NAMED))
    b = resolve(cfg_with(f"data.path={tmp_path / 'all.jsonl'}", NAMED, "seed=7"))
    assert (len(a["train"]), len(a["validation"])) == (90, 10)
    assert col(a["validation"], "idx") == col(b["validation"], "idx")  # the split does not follow the training seed
    assert sorted(col(a["train"], "idx") + col(a["validation"], "idx")) == sorted(train.idx[:100])
    (tmp_path / "glue").mkdir()
    write(train.iloc[:30], tmp_path / "glue" / "train.tsv", "tsv")
    write(validation.iloc[:10], tmp_path / "glue" / "dev.tsv", "tsv")
    assert len(resolve(cfg_with(f"data.path={tmp_path / 'glue'}", NAMED))["validation"]) == 10


def test_the_single_files_split_is_data_eval_fraction(tmp_path, sst2_rows):
    """data.eval_fraction of the rows, rounded up as HF's train_test_split rounds a fraction: 0.1 is the 90/10
    split above, row for row."""
    write(sst2_rows[0].iloc[:100], tmp_path / "all.parquet", "parquet")
    path = f"data.path={tmp_path / 'all.parquet'}"
    quarter = resolve(cfg_with(path, NAMED, "data.eval_fraction=0.25"))
    assert (len(quarter["train"]), len(quarter["validation"])) == (75, 25)
    tenth = resolve(cfg_with(path, NAMED))
    hf = Dataset.from_pandas(sst2_rows[0].iloc[:100], preserve_index=False).train_test_split(test_size=0.1, seed=0)
    assert col(tenth["validation"], "idx") == col(hf["test"], "idx")
    write(sst2_rows[0].iloc[:3], tmp_path / "three.parquet", "parquet")
    with pytest.raises(DataError, match=r"has 3 rows; data.eval_fraction=0.7 of them would leave none for train"):
        resolve(cfg_with(f"data.path={tmp_path / 'three.parquet'}", NAMED, "data.eval_fraction=0.7"))


def test_string_labels_are_the_classes_data_label_names_names(tmp_path, sst2_rows):
    """Labels written as class names: each name's class id is its position in data.label_names, as the same rows
    with integer labels."""
    train = sst2_rows[0].iloc[:40]
    as_text = train.assign(label=train.label.map({0: "neg", 1: "pos"}))
    for frame, folder in ((train, "ids"), (as_text, "names")):
        (tmp_path / folder).mkdir()
        write(frame, tmp_path / folder / "train.csv", "csv")
        write(frame.iloc[:10], tmp_path / folder / "validation.csv", "csv")
    ids = resolve(cfg_with(f"data.path={tmp_path / 'ids'}", "data.label_names=[neg,pos]"))
    names = resolve(cfg_with(f"data.path={tmp_path / 'names'}", "data.label_names=[neg,pos]"))
    for split, frame in (("train", train), ("validation", train.iloc[:10])):
        assert col(names[split], "label") == col(ids[split], "label") == list(frame.label)
    assert label_names(names, cfg_with().data) == ["neg", "pos"]
    swapped = resolve(cfg_with(f"data.path={tmp_path / 'names'}", "data.label_names=[pos,neg]"))
    assert col(swapped["train"], "label") == [1 - y for y in col(ids["train"], "label")]
    odd = as_text.label.replace({"pos": "positive"})
    msg = bad(tmp_path / "odd", as_text.assign(label=odd), "data.label_names=[neg,pos]", fmt="csv")
    assert msg.startswith(f"{(odd == 'positive').sum()} rows in split 'train' of ") and msg.endswith(
        f"have labels that data.label_names=[neg, pos] does not name: 'positive' (first: row "
        f"{list(odd).index('positive')}); add them to data.label_names or fix those rows")
    msg = bad(tmp_path / "unnamed", as_text, fmt="csv")
    assert "are strings (e.g. 'neg'), not class ids; name the classes in class-id order with data.label_names " \
           "(e.g. data.label_names=[neg,pos])" in msg


# ----------------------------------------------------------------------------------------------------------
# bad data: one line, names the problem and the fix


def bad(tmp_path, train: pd.DataFrame, *overrides, fmt="parquet", validation=None):
    """The DataError message for a folder holding `train` (and `validation`, default: the same rows)."""
    folder = tmp_path / "data"
    folder.mkdir(parents=True, exist_ok=True)
    write(train, folder / f"train.{fmt}", fmt)
    write(train if validation is None else validation, folder / f"validation.{fmt}", fmt)
    with pytest.raises(DataError) as exc:
        resolve(cfg_with(f"data.path={folder}", *overrides))
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_missing_path_and_unknown_dataset(tmp_path):
    with pytest.raises(DataError, match=r"data.path='/no/such/data' does not exist; .*data.path=null"):
        resolve(cfg_with("data.path=/no/such/data"))
    with pytest.raises(DataError) as exc:
        resolve(cfg_with("data.name=someone/nothing_here"))
    msg = str(exc.value)
    for part in ("someone/nothing_here", str(REPO_ROOT.parent / "shared" / "datasets" / "nothing_here"), "Hub",
                 "data.path=", "NORMLAB_DATA_DIR"):
        assert part in msg, (part, msg)


def test_empty_file_and_empty_dataset(tmp_path, sst2_rows):
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "train.csv").write_text("")
    (tmp_path / "e" / "validation.csv").write_text("")
    with pytest.raises(DataError, match=r"train.csv is empty \(0 bytes\)"):
        resolve(cfg_with(f"data.path={tmp_path / 'e'}"))
    msg = bad(tmp_path, sst2_rows[0].iloc[:0])
    assert "train.parquet is empty (0 rows)" in msg
    msg = bad(tmp_path / "csv", sst2_rows[0].iloc[:0], fmt="csv")  # a header and nothing else
    assert "split 'train'" in msg and "is empty (0 rows)" in msg


def test_missing_split_lists_the_splits(tmp_path, sst2_rows):
    msg = bad(tmp_path, sst2_rows[0].iloc[:20], "data.eval_split=test")
    assert "split 'test' not in" in msg and "splits: train, validation" in msg and "data.eval_split" in msg


def test_empty_or_missing_text_rows(tmp_path, sst2_rows):
    train = sst2_rows[0].iloc[:20].copy()
    train.loc[5, "sentence"] = "   "
    train.loc[9, "sentence"] = None
    msg = bad(tmp_path, train)
    assert "2 of 20 rows" in msg and "first: row 5" in msg and "'sentence'" in msg and "drop or fill" in msg


def test_text_column_missing_or_not_text(tmp_path, sst2_rows):
    train = sst2_rows[0].iloc[:20]
    msg = bad(tmp_path, train, "data.text_column=text")
    assert "text column 'text' not in split 'train'" in msg and "idx, sentence, label" in msg
    assert "data.text_column=sentence" in msg
    msg = bad(tmp_path, train, "data.text_column=idx")
    assert "data.text_column='idx' holds int" in msg and "not text" in msg and "sentence" in msg


def test_labels_missing_null_or_out_of_range(tmp_path, sst2_rows):
    train = sst2_rows[0].iloc[:20].copy()
    msg = bad(tmp_path, train, "data.label_column=sentiment")
    assert "label column 'sentiment' not in" in msg and "data.label_column" in msg and "label" in msg
    with_null = train.astype({"label": "Int64"})
    with_null.loc[3, "label"] = None
    msg = bad(tmp_path, with_null)
    assert "1 rows" in msg and "no label" in msg and "first: row 3" in msg
    out_of_range = train.copy()
    out_of_range.loc[7, "label"] = 2
    msg = bad(tmp_path, out_of_range, "data.num_labels=2")
    assert "outside [0, 2)" in msg and "first: row 7, label 2" in msg and "data.num_labels" in msg
    unlabeled_eval = train.assign(label=-1)  # like GLUE's test split
    msg = bad(tmp_path, train, validation=unlabeled_eval)
    assert "split 'validation'" in msg and "20 rows" in msg and "label -1" in msg and "data.eval_split" in msg
    msg = bad(tmp_path, train.assign(label=train.label.map({0: "neg", 1: "pos"})))
    assert "strings" in msg and "'neg'" in msg
    msg = bad(tmp_path, train.assign(label=train.label + 0.5))
    assert "not an integer class id" in msg and "row 0" in msg


def test_mlm_needs_no_labels(tmp_path, sst2_rows):
    train = sst2_rows[0].iloc[:20][["sentence"]]
    write(train, tmp_path / "train.csv", "csv")
    write(train, tmp_path / "validation.csv", "csv")
    dsd = resolve(cfg_with(f"data.path={tmp_path}", "task=mlm"))
    assert dsd["train"].column_names == ["sentence"]


def test_num_labels_from_config_or_inferred(tmp_path, sst2_rows):
    train = sst2_rows[0].iloc[:30]
    write(train, tmp_path / "train.parquet", "parquet")
    write(train, tmp_path / "validation.parquet", "parquet")
    assert len(label_names(resolve(cfg_with(f"data.path={tmp_path}", NAMED)), cfg_with().data)) == 2
    assert len(label_names(resolve(cfg_with(f"data.path={tmp_path}", "data.num_labels=5",
                                            "data.label_names=[a,b,c,d,e]")), cfg_with().data)) == 5


# ----------------------------------------------------------------------------------------------------------
# tokenizer


def test_tokenizer_round_trips_through_save_pretrained(small, tmp_path):
    from transformers import AutoTokenizer

    cfg, dsd, tok, _ = small
    assert tok.pad_token_id == 0 and tok.model_max_length == cfg.data.max_length
    assert [tok.pad_token, tok.unk_token, tok.cls_token, tok.sep_token, tok.mask_token] == [
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert len(tok) <= cfg.model.vocab_size
    text = "A Gorgeous, Witty film!"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
    assert tok.decode(ids, skip_special_tokens=True).replace(" ,", ",").replace(" !", "!") == text.lower()
    tok.save_pretrained(tmp_path / "tok")
    saved = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert not {"local_files_only", "is_local"} & saved.keys()  # this load's settings are not the next one's
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    sentences = col(dsd["validation"], "sentence")[:20]
    assert loaded(sentences)["input_ids"] == tok(sentences)["input_ids"]
    assert loaded.pad_token_id == 0 and loaded.mask_token == "[MASK]" and len(loaded) == len(tok)


def test_tokenizer_cache_hit_and_key(small, monkeypatch):
    import normlab.data.tokenizer as tokenizer_module

    cfg, dsd, tok, _ = small
    texts = col(dsd["train"], "sentence")

    def no_training(*args, **kwargs):
        raise AssertionError("the cached tokenizer should have been used")

    monkeypatch.setattr(tokenizer_module, "_train_tokenizer", no_training)
    again = get_tokenizer(cfg.data, cfg.model.vocab_size, texts)
    assert again.get_vocab() == tok.get_vocab()
    with pytest.raises(AssertionError, match="cached"):  # other text -> another key -> retrain
        get_tokenizer(cfg.data, cfg.model.vocab_size, texts[:-1])
    key = tokenizer_module.tokenizer_cache_key
    assert key(texts, 400, "sentence") != key(texts, 500, "sentence")


def test_tokenize_splits_truncates_and_records_lengths(small):
    cfg, dsd, tok, tokenized = small
    train = tokenized["train"]
    assert set(train.column_names) - {"token_type_ids"} == {"input_ids", "attention_mask", "labels", "length"}
    assert col(train, "labels") == col(dsd["train"], "label")
    assert all(len(ids) == n for ids, n in zip(col(train, "input_ids"), col(train, "length")))
    short = tokenize_splits(dsd, tok, load_config(overrides=SMALL + ["data.max_length=8"]).data, "classification")
    assert max(col(short["train"], "length")) == 8 and short["train"][0]["input_ids"][-1] == tok.sep_token_id


# ----------------------------------------------------------------------------------------------------------
# batching


def test_samplers_are_deterministic_and_cover_every_index_once():
    lengths = np.random.default_rng(0).integers(3, 60, size=1000)
    for make in (lambda s: LengthGroupedBatchSampler(lengths, 32, seed=s, mega_batch_mult=4),
                 lambda s: RandomBatchSampler(1000, 32, seed=s)):
        a, b, c = make(1), make(1), make(2)
        e0 = list(a)
        assert e0 == list(b) and e0 != list(c)
        a.set_epoch(1)
        e1 = list(a)
        assert e1 != e0
        b.set_epoch(1)
        assert list(b) == e1
        for epoch in (e0, e1):
            assert sorted(i for batch in epoch for i in batch) == list(range(1000))
            assert len(epoch) == len(a) == 32
            assert [len(x) for x in epoch[:-1]] == [32] * 31 and len(epoch[-1]) == 1000 - 31 * 32  # partial last
    dropped = LengthGroupedBatchSampler(lengths, 32, seed=0, drop_last=True)
    assert len(list(dropped)) == len(dropped) == 31 and all(len(x) == 32 for x in dropped)


def test_sampler_under_accelerate_sharding_covers_everything_and_follows_set_epoch():
    from accelerate.data_loader import prepare_data_loader

    lengths = np.random.default_rng(0).integers(3, 60, size=500)
    epochs = {0: [], 1: []}
    for rank in range(2):
        sampler = LengthGroupedBatchSampler(lengths, 16, seed=3, mega_batch_mult=4)
        loader = DataLoader(list(range(500)), batch_sampler=sampler, collate_fn=lambda x: x)
        shard = prepare_data_loader(loader, num_processes=2, process_index=rank, put_on_device=False)
        for epoch in (0, 1):
            shard.set_epoch(epoch)
            epochs[epoch] += [i for batch in shard for i in batch]
            assert sampler.epoch == epoch
    for seen in epochs.values():
        assert set(seen) == set(range(500))
    assert epochs[0] != epochs[1]


def _padded_fraction(batches, lengths) -> float:
    """Pad fraction of index batches, each padded to its longest member, from the lengths alone."""
    real = sum(int(lengths[b].sum()) for b in batches)
    slots = sum(int(lengths[b].max()) * len(b) for b in batches)
    return 1.0 - real / slots


def test_length_grouping_keeps_sst2_padding_under_5_percent():
    # Real SST-2 training lengths; GLUE's text is pre-tokenized with spaces, so words + [CLS]/[SEP] track the
    # tokenizer's lengths closely (and avoid tokenizing 67k sentences in a unit test).
    sentences = pd.read_parquet(MIRROR / "train.parquet", columns=["sentence"]).sentence
    lengths = np.minimum(sentences.str.split().str.len().to_numpy() + 2, 64)
    grouped = _padded_fraction(list(LengthGroupedBatchSampler(lengths, 32, seed=0)), lengths)
    random = _padded_fraction(list(RandomBatchSampler(len(lengths), 32, seed=0)), lengths)
    assert grouped <= 0.05
    assert random > 0.5


def test_pad_fraction():
    assert pad_fraction(torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])) == pytest.approx(0.25)
    assert pad_fraction([[1, 1]]) == 0.0


def test_build_dataloaders_classification(small):
    cfg, _, tok, tokenized = small
    train_loader, eval_loaders = build_dataloaders(cfg, tok, tokenized, pad_to_multiple_of=8)
    assert list(eval_loaders) == ["eval"]  # no dev rows held out by default
    eval_loader = eval_loaders["eval"]
    batches = list(train_loader)
    assert sum(len(b["labels"]) for b in batches) == 300
    for b in batches:
        assert set(b) - {"token_type_ids"} == {"input_ids", "attention_mask", "labels"}  # no `length`
        assert b["input_ids"].shape[1] % 8 == 0 and b["input_ids"].shape == b["attention_mask"].shape
        assert ((b["input_ids"] == tok.pad_token_id) == (b["attention_mask"] == 0)).all()
    grouped = np.mean([pad_fraction(b["attention_mask"]) for b in batches])
    eval_lengths = [int(m.sum()) for b in eval_loader for m in b["attention_mask"]]
    assert eval_lengths == sorted(eval_lengths) and len(eval_lengths) == 60
    unsorted, _ = build_dataloaders(load_config(overrides=SMALL + ["data.group_by_length=false"]), tok, tokenized)
    assert isinstance(unsorted.batch_sampler, RandomBatchSampler)
    assert grouped < np.mean([pad_fraction(b["attention_mask"]) for b in unsorted])



def test_dev_rows_are_the_last_training_rows_and_never_trained_on(small, sst2_rows):
    """data.dev_rows holds out the training split's last rows as the `dev` split (evaluated as dev/*): the training
    rows stay the first data.max_train_samples, and a config whose training rows would reach them is refused."""
    cfg, dsd, tok, _ = small
    full = pd.read_parquet(MIRROR / "train.parquet")
    held = resolve(cfg_with(*SMALL, "data.dev_rows=40"))
    assert held["train"]["sentence"] == dsd["train"]["sentence"]  # the same 300 training rows as without
    assert held["dev"]["sentence"] == full["sentence"].iloc[-40:].tolist()
    assert held["dev"]["label"] == full["label"].iloc[-40:].tolist()
    assert held["dev"].features["label"] == dsd["train"].features["label"]  # the same ClassLabel
    c = cfg_with(*SMALL, "data.dev_rows=40")
    _, loaders = build_dataloaders(c, tok, tokenize_splits(held, tok, c.data, c.task))
    assert list(loaders) == ["eval", "dev"] and sum(len(b["labels"]) for b in loaders["dev"]) == 40
    with pytest.raises(DataError, match=r"^data.max_train_samples=67340 overlaps the last data.dev_rows=40 rows.*"
                                        r"train on at most 67309 rows"):
        resolve(cfg_with(*SMALL, "data.dev_rows=40", "data.max_train_samples=67340"))
    with pytest.raises(DataError, match=r"^data.dev_rows=67349 leaves no training rows"):
        resolve(cfg_with(*SMALL, "data.dev_rows=67349", "data.max_train_samples=null"))
    rest = resolve(cfg_with(*SMALL, "data.dev_rows=67000", "data.max_train_samples=null"))
    assert len(rest["train"]) == 349 and len(rest["dev"]) == 67000  # without a limit: every other row trains

def test_pad_rows_collates_as_hf_data_collator_with_padding(small):
    """Training's classification collate: pad_rows gives exactly the tensors of transformers' DataCollatorWithPadding
    (the collate it replaced), with and without rounding the width up to a multiple of 8."""
    from transformers import DataCollatorWithPadding

    _, _, tok, tokenized = small
    rows = [tokenized["train"][i] for i in range(0, 60, 7)]
    for multiple_of in (None, 8):
        ours = pad_rows(rows, tok.pad_token_id, multiple_of=multiple_of)
        theirs = DataCollatorWithPadding(tok, pad_to_multiple_of=multiple_of)(
            [{k: v for k, v in row.items() if k != "length"} for row in rows])
        assert set(ours) == set(theirs) == {"input_ids", "attention_mask", "labels"}
        for key in theirs:
            assert torch.equal(ours[key], theirs[key]) and ours[key].dtype == theirs[key].dtype, key


def test_build_dataloaders_mlm(small):
    _, dsd, tok, _ = small
    cfg = load_config(overrides=SMALL + ["task=mlm"])
    tokenized = tokenize_splits(dsd.remove_columns("label"), tok, cfg.data, cfg.task)
    assert "labels" not in tokenized["train"].column_names
    torch.manual_seed(0)
    train_loader, _ = build_dataloaders(cfg, tok, tokenized)
    b = next(iter(train_loader))
    masked = b["labels"] != -100
    assert masked.any() and (b["labels"][~masked] == -100).all()
    assert not masked[b["attention_mask"] == 0].any()  # padding is never a target
    assert not masked[:, 0].any()  # nor [CLS]
    share = masked.sum() / b["attention_mask"].sum()
    assert 0.03 < share < 0.4  # ~15% of real tokens


def test_trained_tokenizer_is_the_same_in_every_process():
    # The vocabulary must not depend on the process: a tokenizer trainer that numbers pieces in hash-map order
    # (WordPiece's, in tokenizers) gives each fresh cache other ids, and runs then differ between clones.
    script = ("import sys, pandas as pd; from normlab.data.tokenizer import _train_tokenizer; "
              f"texts = pd.read_parquet({str(MIRROR / 'train.parquet')!r}).sentence.tolist()[:3000]; "
              "sys.stdout.write(_train_tokenizer(texts, 1000).to_str())")
    runs = [subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                           check=True).stdout for _ in range(3)]
    assert len(json.loads(runs[0])["model"]["vocab"]) == 1000
    assert runs[0] == runs[1] == runs[2]
