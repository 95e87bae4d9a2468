"""The tokenizer and tokenizing: a BPE tokenizer trained on the training text (cached on disk and checked when
read) or a Hub tokenizer named by data.tokenizer; the tokenized splits (cached by datasets)."""

import hashlib

from normlab.data.common import DataError, cache_dir, column
from normlab.data.sources import resolve_dataset
from normlab.files.cache import cached_folder, cached_map

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # [PAD] = 0: the model's default pad_token_id
TOKENIZER_RECIPE = "bpe-metaspace-bert-v1"  # bump when the recipe below changes: it is part of the cache key


def _train_tokenizer(texts: list[str], vocab_size: int):
    """A BPE tokenizer with BERT's text handling (lowercase, strip accents, split on whitespace and punctuation);
    word-initial pieces carry "▁" (Metaspace). BPE, not WordPiece: its vocabulary is the same every time
    (docs/architecture.md)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)  # clean text, split CJK, strip accents, lowercase
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.BertPreTokenizer(), pre_tokenizers.Metaspace()])
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    return tok


def tokenizer_cache_key(texts: list[str], vocab_size: int, text_column: str) -> str:
    """Hash of everything the trained tokenizer depends on: the recipe, vocab size, column and the text itself."""
    h = hashlib.sha256(f"{TOKENIZER_RECIPE}|{vocab_size}|{text_column}|{len(texts)}".encode())
    for t in texts:
        h.update(t.encode("utf-8", "surrogatepass") + b"\x00")
    return h.hexdigest()[:20]


def _as_texts(train_texts, text_column: str) -> list[str]:
    """A list of strings from a list, a datasets Column (`ds[col]`), or a Dataset (its text column), fast."""
    if hasattr(train_texts, "column_names"):
        return column(train_texts, text_column)
    return train_texts[:]  # a Column's slice reads it in one go (iterating reads row by row, slowly); a list's copies


def get_tokenizer(d, vocab_size: int, train_texts):
    """`d`: the config's `data` section. data.tokenizer null: a BPE tokenizer of at most `vocab_size` tokens
    (model.vocab_size; the model takes len(tokenizer)) trained on `train_texts` (strings, `ds[text_column]` or the
    Dataset), cached on disk; otherwise AutoTokenizer.from_pretrained(data.tokenizer). model_max_length =
    data.max_length."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if d.tokenizer:
        try:
            tokenizer = AutoTokenizer.from_pretrained(d.tokenizer)
        except Exception as e:
            raise DataError(f"tokenizer {d.tokenizer!r} could not be loaded ({type(e).__name__}); give a local "
                            f"tokenizer folder or Hub id, or set data.tokenizer=null to train a BPE "
                            f"tokenizer") from None
        if tokenizer.pad_token is None:  # e.g. GPT-2: padding needs some token; it is masked out anyway
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    else:
        texts = _as_texts(train_texts, d.text_column)
        key = tokenizer_cache_key(texts, vocab_size, d.text_column)

        def train():
            return PreTrainedTokenizerFast(tokenizer_object=_train_tokenizer(texts, vocab_size), unk_token="[UNK]",
                                           pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                                           mask_token="[MASK]", model_max_length=d.max_length)

        # written atomically, checked when read, rebuilt when damaged; every process loads the same files
        tokenizer = cached_folder(cache_dir() / "tokenizers" / key, make=train,
                                  save=lambda tok, folder: tok.save_pretrained(str(folder)),
                                  load=lambda folder: PreTrainedTokenizerFast.from_pretrained(str(folder)),
                                  what="the cached tokenizer")
    tokenizer.model_max_length = d.max_length
    return _forget_load_arguments(tokenizer)


def _forget_load_arguments(tokenizer):
    """Drop from_pretrained's `local_files_only` and `is_local`, which transformers keeps among the init arguments:
    save_pretrained would pass this load's offline settings on to whoever loads the saved tokenizer."""
    for key in ("local_files_only", "is_local"):
        tokenizer.init_kwargs.pop(key, None)
    return tokenizer


def tokenize_splits(dsd, tokenizer, d, task: str):
    """Tokenized splits truncated to data.max_length: input_ids, attention_mask, token_type_ids (if the tokenizer
    makes them), `length` (for length grouping), `labels` (classification) or `special_tokens_mask` (mlm); cached
    under a fingerprint of (data, tokenizer, max_length, task) by normlab.files.cache.cached_map. `d`: the config's
    `data` section."""
    max_length, text_col, label_col = d.max_length, d.text_column, d.label_column
    tok_id = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16]

    def encode(batch):
        enc = tokenizer(batch[text_col], truncation=True, max_length=max_length,
                        return_special_tokens_mask=task == "mlm")
        enc["length"] = [len(ids) for ids in enc["input_ids"]]
        if task == "classification":
            enc["labels"] = batch[label_col]
        return enc

    import datasets

    out = datasets.DatasetDict()
    for split, ds in dsd.items():
        fingerprint = hashlib.sha256(
            f"{ds._fingerprint}|{tok_id}|{max_length}|{task}|{text_col}|{label_col}".encode()).hexdigest()[:16]
        out[split] = cached_map(ds, encode, fingerprint, f"the cached tokenized split {split!r}", batched=True,
                                remove_columns=ds.column_names, desc=f"tokenizing {split}")
    return out


def load_tokenized(cfg):
    """(raw DatasetDict, tokenizer, tokenized splits) of a run config: resolve, tokenizer, tokenize."""
    d = cfg.data
    dsd = resolve_dataset(d, with_labels=cfg.task == "classification")
    tokenizer = get_tokenizer(d, cfg.model.vocab_size, dsd[d.train_split][d.text_column])
    return dsd, tokenizer, tokenize_splits(dsd, tokenizer, d, cfg.task)
