"""Documents of real sentences (data.doc_sizes, normlab/data/documents.py): the evaluation documents share no sentence
with the training ones, each is labelled by its sentences' majority, sizes come from the declared set, the same seed
gives the same documents, a bad set is refused in one line, they are cached, and a run trains on them."""

import math

import pandas as pd
import pytest

from normlab.config.loader import REPO_ROOT, load_config
from normlab.data.documents import SENTENCE_IDS
from normlab.data.sources import DataError, column, resolve_dataset
from normlab.errors import ConfigError
from normlab.files.cache import MANIFEST

MIRROR = REPO_ROOT.parent / "shared" / "datasets" / "sst2"
SIZES = [1, 3, 5, 7]
HELD_OUT = 120


@pytest.fixture(autouse=True)
def _offline_and_private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def sentences(tmp_path_factory):
    """A folder with 500 training and 60 validation rows of the shared SST-2, and the training rows (DataFrame)."""
    folder = tmp_path_factory.mktemp("sst2_small")
    train = pd.read_parquet(MIRROR / "train.parquet").iloc[:500]
    train.to_parquet(folder / "train.parquet", index=False)
    pd.read_parquet(MIRROR / "validation.parquet").iloc[:60].to_parquet(folder / "validation.parquet", index=False)
    return folder, train


def docs_config(folder, *overrides):
    return load_config(overrides=[f"data.path={folder}", "data.label_names=[negative,positive]",
                                  f"data.doc_sizes=[{','.join(map(str, SIZES))}]",
                                  f"data.doc_eval_sentences={HELD_OUT}", *overrides])


def documents(folder, *overrides):
    return resolve_dataset(docs_config(folder, *overrides).data, with_labels=True)


def sentence_ids(ds) -> list[list[int]]:
    return column(ds, SENTENCE_IDS)


def test_no_sentence_is_in_both_training_and_evaluation_documents(sentences):
    folder, train = sentences
    dsd = documents(folder, "data.dev_rows=10")
    texts = train["sentence"].tolist()
    used = {split: [i for doc in sentence_ids(dsd[split]) for i in doc] for split in ("train", "dev", "validation")}
    for split, ids in used.items():
        assert len(ids) == len(set(ids)), f"a sentence twice in {split}"
    # by row and by text (SST-2's training split repeats some phrases): the dev documents are training documents
    assert not set(used["validation"]) & (set(used["train"]) | set(used["dev"]))
    assert not {texts[i] for i in used["validation"]} & {texts[i] for i in used["train"] + used["dev"]}
    assert not set(used["train"]) & set(used["dev"])
    assert HELD_OUT - 7 - 3 <= len(used["validation"]) <= HELD_OUT  # held out, less a few repeats and the remainder
    assert len(used["train"]) + len(used["dev"]) >= len(texts) - HELD_OUT - 6
    # each document's text is its sentences, in order, joined by spaces
    for ds in (dsd["train"], dsd["validation"]):
        assert column(ds, "sentence") == [" ".join(texts[i] for i in doc) for doc in sentence_ids(ds)]


def test_labels_are_the_majority_and_sizes_come_from_the_declared_set(sentences):
    folder, train = sentences
    labels = train["label"].tolist()
    dsd = documents(folder)
    for ds in (dsd["train"], dsd["validation"]):
        docs = sentence_ids(ds)
        assert {len(doc) for doc in docs} <= set(SIZES)
        majority = [int(2 * sum(labels[i] for i in doc) > len(doc)) for doc in docs]
        assert column(ds, "label") == majority
    assert {len(doc) for doc in sentence_ids(dsd["train"])} == set(SIZES)  # ~90 documents: every size drawn
    assert dsd["train"].features["label"].names == ["negative", "positive"]


def test_the_same_seed_gives_the_same_documents_and_another_seed_others(sentences, tmp_path, monkeypatch):
    folder, _ = sentences
    built = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path / name))  # built afresh each time, not read from a cache
        dsd = documents(folder, f"data.doc_seed={seed}")
        built[name] = {split: (sentence_ids(ds), column(ds, "label")) for split, ds in dsd.items()}
    assert built["a"] == built["b"]
    assert built["a"]["train"][0] != built["c"]["train"][0]
    assert built["a"]["validation"][0] != built["c"]["validation"][0]


def test_neither_the_run_seed_nor_the_sizes_order_changes_the_documents(sentences, tmp_path, monkeypatch):
    folder, _ = sentences
    a = documents(folder, "seed=1")
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path / "other"))  # built afresh
    b = documents(folder, "seed=2", "data.doc_sizes=[7,5,3,1]")
    assert sentence_ids(a["train"]) == sentence_ids(b["train"])


@pytest.mark.parametrize("sizes, problem", [("[2,3]", "size 2 is even"), ("[1,3,3]", "names a size twice"),
                                            ("[0,1]", "size 0 is not >= 1"), ("[]", "is empty")])
def test_a_bad_size_set_is_refused_in_one_line_with_the_valid_choices(sizes, problem):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[f"data.doc_sizes={sizes}"])
    message = str(e.value)
    assert problem in message and "\n" not in message
    assert "give distinct odd sizes >= 1, e.g. data.doc_sizes=[1, 3, 5, 7], or null" in message


def test_train_refuses_a_bad_size_set_in_one_line_before_it_loads(tmp_path, capsys):
    from train_utils import run_here

    assert run_here(tmp_path / "run", "data.doc_sizes=[4]") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: data.doc_sizes=[4]: size 4 is even")
    assert not (tmp_path / "run").exists()


def test_too_many_held_out_sentences_one_split_or_three_classes_are_refused(sentences, tmp_path):
    folder, train = sentences
    with pytest.raises(DataError, match=r"data.doc_eval_sentences=500 holds out every sentence"):
        documents(folder, "data.doc_eval_sentences=500")
    with pytest.raises(DataError, match=r"data.eval_split='train' is the training split"):
        documents(folder, "data.eval_split=train")
    three = tmp_path / "three"
    three.mkdir()
    train.assign(label=[i % 3 for i in range(len(train))]).to_parquet(three / "train.parquet", index=False)
    train.iloc[:20].to_parquet(three / "validation.parquet", index=False)
    with pytest.raises(DataError, match=r"only two classes keep free of ties; .* has 3 labels"):
        documents(three, "data.label_names=[a,b,c]")


def test_documents_are_cached_and_a_damaged_entry_is_rebuilt(sentences, tmp_path, capsys):
    folder, _ = sentences
    first = sentence_ids(documents(folder)["train"])
    (entry,) = (tmp_path / "cache" / "documents").iterdir()
    assert (entry / MANIFEST).is_file()
    again = documents(folder)
    assert all(str(f["filename"]).startswith(str(entry)) for f in again["train"].cache_files)
    arrow = next((entry / "train").glob("data-*.arrow"))  # save_to_disk's (the cache-*.arrow beside it: casts')
    data = arrow.read_bytes()
    arrow.unlink()  # a new file: the datasets above keep their memory-mapped pages
    arrow.write_bytes(data[:100])
    rebuilt = documents(folder)
    assert "warning: the cached documents" in capsys.readouterr().err
    assert sentence_ids(rebuilt["train"]) == first


def test_the_variant_file_is_a_few_keys_over_the_default():
    cfg = load_config("sst2_docs")
    assert cfg.data.doc_sizes == SIZES and cfg.data.max_length == 256 and cfg.model.max_position_embeddings == 256
    assert len((REPO_ROOT / "configs" / "sst2_docs.yaml").read_text().splitlines()) <= 5


def test_a_tiny_run_trains_on_documents_end_to_end(sentences, tmp_path):
    from train_utils import run_here, summary

    folder, _ = sentences
    out = tmp_path / "run"
    assert run_here(out, f"data.path={folder}", "data.label_names=[negative,positive]", "data.doc_sizes=[1,3,5]",
                    f"data.doc_eval_sentences={HELD_OUT}", "data.max_length=128", "model.max_position_embeddings=128",
                    "train.max_steps=4", "train.eval_steps=4", "train.save_steps=4") == 0
    s = summary(out)
    assert s["status"] == "completed" and s["step"] == 4
    assert 0.0 <= s["final"]["eval/accuracy"] <= 1.0


def test_the_padding_command_prints_random_and_grouped_batches(sentences, capsys):
    from normlab.cli.padding import main

    folder, _ = sentences
    assert main(["--config", "sst2_docs", f"data.path={folder}", "data.label_names=[negative,positive]",
                 f"data.doc_eval_sentences={HELD_OUT}", "model.vocab_size=400", "train.batch_size=8"]) == 0
    out = capsys.readouterr().out
    random, grouped = (float(out.split(f"{name} batches:")[1].split("pad fraction ")[1].split(",")[0])
                       for name in ("random", "length-grouped"))
    assert 0 <= grouped < random
    assert "training documents (" in out


def test_scoring_lists_each_eval_document_with_its_size_and_label_for_the_study(sentences):
    """score_runs.py writes STUDY/documents.jsonl from these rows; study "docs" scores its long documents with them."""
    from normlab.study.scoring import document_rows, score_data, score_sets

    folder, _ = sentences
    cfg = docs_config(folder, "data.dev_rows=10")
    dsd = score_data(cfg, 10)
    rows, (texts, labels) = document_rows(cfg, dsd), score_sets(cfg, 10, dsd)["val"]
    assert [r["row"] for r in rows] == list(range(len(texts))) and [r["label"] for r in rows] == list(labels)
    assert [r["sentences"] for r in rows] == [len(doc) for doc in sentence_ids(dsd["validation"])]
    sentences_cfg = load_config(overrides=[f"data.path={folder}", "data.label_names=[negative,positive]",
                                           "data.dev_rows=10"])
    assert document_rows(sentences_cfg, score_data(sentences_cfg, 10)) == []


def test_the_docs_study_scores_long_documents_apart():
    """configs/study/hooks/docs.py: acc_long reads only the documents of 5 sentences or more."""
    from normlab.study import engine
    from normlab.study.records import VAL, RunRecord

    engine.load_hooks(REPO_ROOT / "configs" / "study" / "hooks" / "docs.py")
    docs = [{"split": "val", "row": i, "sentences": k, "label": y}
            for i, (k, y) in enumerate([(1, 0), (7, 1), (5, 0), (3, 1), (5, 1)])]
    study = type("Study", (), {"tables": {"documents": docs}})()
    run = RunRecord(scores={VAL: {"pred": "01111"}}, extra={"pad_fraction": 0.6, "tokens_per_s": 900.0})
    assert engine.MEASURES["acc_long"](run, study) == pytest.approx(2 / 3)  # rows 1, 2, 4: right, wrong, right
    assert engine.MEASURES["pad_fraction"](run, study) == 0.6
    assert engine.MEASURES["tokens_per_s"](run, study) == 900.0
    assert math.isnan(engine.MEASURES["tokens_per_s"](RunRecord(), study))  # a record from before scoring kept it
    # read from the final model like accuracy, so the declared horizon rule guards L and L_random too
    assert engine.AT_END["acc_long"] == "accuracy" and "pad_fraction" not in engine.AT_END
