"""Looking inside a trained model, through the model's hook points: every head's attention
(`capture`), scored (`metrics`, pure NumPy), dumped (`dump`), drawn (`pictures`) and viewed offline
(`viewer`), which `attention` runs as `llmcli inspect-attention`; which heads matter
(`ablation`); and, sharing `answers` (the run, the prompt, the answer's metric), what each layer
predicts (`lens`), which activations carry an answer (`patching`) and which parts write it
directly (`attribution`); and sparse autoencoders on a hook point, their features read,
steered and removed (the subpackage `sae`). The heads' scores on the repeated-token probe, the
loss on a text and removing heads are measurements these build on: `llmcli.evaluation`.

The modules import one way, `metrics` and `dump` at the bottom, `attention` on top.
"""
