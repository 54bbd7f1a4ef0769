"""Looking inside a trained model, through the model's hook points: every head's attention
(`capture`), scored (`metrics`, pure NumPy), dumped (`dump`), drawn (`pictures`) and viewed offline
(`viewer`), which `attention` runs as `llmcli inspect-attention`; which heads matter (`ablation`);
and a run's loss on a text (`evaluate`, `llmcli eval`).

The modules import one way, `metrics` and `dump` at the bottom, `attention` on top. This file
imports none of them, so `metrics` loads without torch.
"""
