"""Text to batches: corpora (`corpus`), tokenizers (`tokenizer`), the token cache with its splits
(`tokens`, what it gives in `prepared`), conversations with their loss mask (`chat`), and the
training batches drawn from them (`batches`)."""
