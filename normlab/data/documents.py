"""Documents made of real sentences (data.doc_sizes): the training split's sentences, shuffled by data.doc_seed, cut
into documents of k sentences (k drawn from data.doc_sizes), each labelled by the majority of its sentences' labels.
The last data.doc_eval_sentences sentences of the shuffle are held out: the evaluation documents are made of them
alone, so no sentence is in both. Built at load time and cached like the tokenizer (docs/training.md, "Documents")."""

import hashlib
from collections import Counter

import numpy as np

from normlab.data.common import DataError, cache_dir, check_text, column

DOCUMENTS_RECIPE = "documents-v1"  # bump when the composition below changes: it is part of the cache key
SENTENCE_IDS = "sentence_ids"  # each document's sentences, as row numbers of the source's training split
EXAMPLE_SIZES = "[1, 3, 5, 7]"


def doc_sizes_problem(sizes) -> str | None:
    """What is wrong with data.doc_sizes (None: nothing, or documents off). Odd sizes only: a majority of an odd
    number of binary labels never ties."""
    if sizes is None:
        return None
    valid = f"give distinct odd sizes >= 1, e.g. data.doc_sizes={EXAMPLE_SIZES}, or null for one row per sentence"
    shown = f"data.doc_sizes=[{', '.join(map(str, sizes))}]"
    if not sizes:
        return f"{shown} is empty; {valid}"
    bad = next((k for k in sizes if k < 1 or k % 2 == 0), None)
    if bad is not None:
        why = "is not >= 1" if bad < 1 else "is even, so a document's majority label could tie"
        return f"{shown}: size {bad} {why}; {valid}"
    if len(set(sizes)) != len(sizes):
        return f"{shown} names a size twice; {valid}"
    return None


def documents_cache_key(texts: list[str], labels: list, d) -> str:
    """Hash of everything the documents depend on: the recipe, the settings, the names they are stored under (splits,
    columns) and the sentences with their labels."""
    settings = (f"{DOCUMENTS_RECIPE}|{sorted(d.doc_sizes)}|{d.doc_seed}|{d.doc_eval_sentences}|{len(texts)}|"
                f"{d.train_split}|{d.eval_split}|{d.text_column}|{d.label_column}")
    h = hashlib.sha256(settings.encode())
    for text, label in zip(texts, labels):
        h.update(f"{text}\x00{label}\x00".encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:20]


def split_sentences(texts: list[str], seed: int, eval_sentences: int) -> tuple[np.ndarray, np.ndarray]:
    """(training sentences, evaluation sentences): row numbers, in the order documents take them. The last
    `eval_sentences` of a seeded shuffle are held out, less any whose text a training sentence also has (SST-2's
    training split repeats some phrases)."""
    order = np.random.default_rng([seed, 0]).permutation(len(texts))
    train, held = order[: len(texts) - eval_sentences], order[len(texts) - eval_sentences :]
    seen = {texts[i] for i in train}
    return train, np.array([i for i in held if texts[i] not in seen], dtype=np.int64)


def cut_documents(pool: np.ndarray, sizes, rng: np.random.Generator) -> list[list[int]]:
    """`pool` cut into consecutive documents whose sizes are drawn uniformly from `sizes`; the few sentences left
    after the last whole document (fewer than max(sizes)) are dropped."""
    # sorted: the order the sizes are given in must not change the documents (nor their cache key)
    ks = rng.choice(np.asarray(sorted(sizes)), size=len(pool) // min(sizes) + 1)
    ends = np.cumsum(ks)
    ends = ends[ends <= len(pool)]
    return [pool[start:end].tolist() for start, end in zip(np.concatenate([[0], ends[:-1]]), ends)]


def _as_documents(doc_rows: list[list[int]], texts: list[str], labels: list | None, d, features):
    """A Dataset of documents: the sentences' ids, their text joined by spaces, their majority label."""
    import datasets

    def join(batch):
        ids = batch[SENTENCE_IDS]
        out = {d.text_column: [" ".join(texts[i] for i in doc) for doc in ids]}
        if labels is not None:  # an odd number of votes between two classes: most_common has no tie to break
            out[d.label_column] = [Counter(labels[i] for i in doc).most_common(1)[0][0] for doc in ids]
        return out

    ids = datasets.Dataset.from_dict({SENTENCE_IDS: doc_rows},
                                     features=datasets.Features({SENTENCE_IDS: features[SENTENCE_IDS]}))
    return ids.map(join, batched=True, features=features, desc="composing documents")


def build_documents(sentences, texts: list[str], labels: list | None, d, source: str):
    """The DatasetDict {train_split: training documents, eval_split: evaluation documents} of `sentences` (the
    source's training split; `texts` and `labels` its columns), deterministic from data.doc_seed."""
    import datasets

    classes = set(labels) if labels is not None else set()
    if len(classes) > 2:
        raise DataError(f"documents are labelled by their sentences' majority, which only two classes keep free of "
                        f"ties; {source} has {len(classes)} labels in column {d.label_column!r}: set "
                        f"data.doc_sizes=null, or use 2-class data")
    train, held = split_sentences(texts, d.doc_seed, d.doc_eval_sentences)
    rng = np.random.default_rng([d.doc_seed, 1])
    docs = {split: cut_documents(pool, d.doc_sizes, rng) for split, pool in ((d.train_split, train),
                                                                               (d.eval_split, held))}
    for split, what in ((d.train_split, f"the {len(train)} training sentences"),
                        (d.eval_split, f"the {len(held)} held-out sentences (data.doc_eval_sentences)")):
        if not docs[split]:
            raise DataError(f"{what} of {source} make no document of data.doc_sizes={list(d.doc_sizes)}; "
                            f"hold out between {max(d.doc_sizes)} and {len(texts) - max(d.doc_sizes)} sentences")
    kept = [d.text_column] + ([d.label_column] if labels is not None else [])
    features = datasets.Features({SENTENCE_IDS: datasets.Sequence(datasets.Value("int64")),
                                  **{c: sentences.features[c] for c in kept}})
    return datasets.DatasetDict({split: _as_documents(rows, texts, labels, d, features)
                                 for split, rows in docs.items()})


def compose_documents(dsd, d, source: str):
    """A DatasetDict of the documents of `dsd`'s training split (the splits data.train_split and data.eval_split;
    the source's own eval split is not used), cached in $NORMLAB_CACHE/documents/<key>/ like the tokenizer."""
    import datasets

    from normlab.files.cache import cached_folder

    problem = doc_sizes_problem(d.doc_sizes)
    if problem:
        raise DataError(problem)
    if d.eval_split == d.train_split:
        raise DataError(f"data.eval_split={d.eval_split!r} is the training split: with data.doc_sizes the eval "
                        f"documents are made of held-out training sentences and named data.eval_split; give it "
                        f"another name (e.g. validation)")
    sentences = dsd[d.train_split]
    check_text(sentences, d.train_split, d.text_column, source)  # a missing or empty sentence: the usual error
    if d.doc_eval_sentences >= len(sentences):
        raise DataError(f"data.doc_eval_sentences={d.doc_eval_sentences} holds out every sentence of split "
                        f"{d.train_split!r} of {source} ({len(sentences)} rows); hold out fewer")
    texts = column(sentences, d.text_column)
    labels = column(sentences, d.label_column) if d.label_column in sentences.column_names else None  # mlm: none
    key = documents_cache_key(texts, labels or [], d)
    return cached_folder(cache_dir() / "documents" / key,
                         make=lambda: build_documents(sentences, texts, labels, d, source),
                         save=lambda docs, folder: docs.save_to_disk(str(folder)),
                         load=lambda folder: datasets.load_from_disk(str(folder)), what="the cached documents")
