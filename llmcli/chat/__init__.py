"""Chat: conversations, the chat template a run holds, and ids with a loss mask.

`llmcli.chat.template` renders messages to text (one Jinja template per run, Hugging Face's
format); `llmcli.chat.conversations` checks messages, reads them from JSONL and encodes them
with the mask of the tokens a model is trained to write.
"""
