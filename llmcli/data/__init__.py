"""Text to batches: corpora (`corpus`), tokenizers (`tokenizer`) trained once per corpus
(`tokenizer_cache`), the token cache (`token_cache`), preparing the splits (`tokens`, what it
gives in `prepared`), the chat template (`chat_template`) and conversations checked and encoded
with their loss mask (`conversations`), put into the cache (`chat`), and the training batches
drawn from them (`batches`, `chat_batches`)."""
