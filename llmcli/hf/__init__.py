"""Hugging Face interoperability: runs exported as `transformers` folders, runs started from them.

`gpt2` maps llmcli's model onto `GPT2LMHeadModel`; `export` writes a run as a folder that
`transformers` loads offline; `load` reads such a folder back (`train.init_from`).
"""
