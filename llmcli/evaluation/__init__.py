"""Measuring a model: figures of its loss (`metrics`: perplexity, the in-context learning
score), its loss on a whole text window by window (`text`), with heads removed if asked (`heads`),
which `run` runs as `llmcli eval`, as on a chat run's conversations the loss of the assistant's
tokens and exact greedy replies (`chat`), on preference pairs DPO's loss and rewards
(`preferences`, over `llmcli.objectives.preference_scores` and `dpo_losses`, which DPO training
minimises), and on prompts with answers greedy pass@1 (`prompts`, with GRPO's rewards); and
every head's scores on the fixed probe of repeated random tokens (`probe`, on where tokens
repeat: `repeats`), which training records at each evaluation and `inspect-attention` reports.

Nothing here imports training or inspection: both build on it. It asks the run's objective
(`llmcli.objectives`) what its own data are, as training does.
"""
