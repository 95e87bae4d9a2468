"""From a dataset name or file to padded batches: the sources, the tokenizer, the batching."""
