"""Text to batches: corpora (`corpus`), tokenizers (`tokenizer`), the token cache and batches
(`tokens`)."""
