"""Hugging Face interoperability: runs exported as `transformers` folders, runs started from them.

`gpt2`, `neox` and `arcee` map llmcli's model onto `GPT2LMHeadModel`, `GPTNeoXForCausalLM` and
`ArceeForCausalLM`; `architectures` picks the one that computes a run's model exactly; `export`
writes a run as a folder that `transformers` loads offline (`llmcli export`); `load` reads such a
folder back (`train.init_from`).
"""
