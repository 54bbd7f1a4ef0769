"""Looking inside a trained model, through the model's hook points: every head's attention
(`capture`), scored (`metrics`, pure NumPy), dumped (`dump`), drawn (`pictures`) and viewed offline
(`viewer`), which `attention` runs as `llmcli inspect-attention`; every head's scores on a fixed
probe of repeated random tokens (`probe`, which training runs too); which heads matter
(`ablation`); a run's loss on a text (`evaluate`, `llmcli eval`); and, sharing `answers` (the
run, the prompt, the answer's metric), what each layer predicts (`lens`), which activations
carry an answer (`patching`) and which parts write it directly (`attribution`).

The modules import one way, `metrics` and `dump` at the bottom, `attention` on top. This file
imports none of them, so `metrics` loads without torch.
"""
