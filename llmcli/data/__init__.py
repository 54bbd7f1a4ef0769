"""Text to batches: corpora (`corpus`), tokenizers (`tokenizer`), the token cache with its splits
(`tokens`), and the training batches drawn from them (`batches`)."""
