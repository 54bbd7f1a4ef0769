"""Sparse autoencoders on a run's hook points: `llmcli sae train`, `eval` and `features`, and
`sample --steer` / `eval --ablate-feature`.

A sparse autoencoder (SAE) rewrites the activation at one hook point (`blocks.1.resid_post`) as a
sparse sum of learned directions, its features (Bricken et al. 2023, "Towards
Monosemanticity"; the TopK form of Gao et al. 2024, "Scaling and evaluating sparse
autoencoders"). The modules, bottom to top:

- `config`: `SAEConfig`, the training settings, checked once;
- `model`: `SparseAutoencoder`, encode / decode, TopK or BatchTopK, unit-norm decoder rows;
- `points`: reading a hook point's activation as `(N, d_in)` rows (the forward stops there),
  putting rows back, and the hook's name in TransformerLens's spelling;
- `folder`: the SAE folder in SAELens's format (`cfg.json`, `sae_weights.safetensors`), which
  SAELens loads as it is;
- `loop`: the training loop that SAEs and transcoders share, with checkpoints and exact resume
  (its resume state: `state`);
- `train`: an SAE's training on activations streamed from the run's own training data;
- `evaluate`: explained variance, L0, dead features and the loss with the SAE spliced in;
- `features`: each feature's top contexts, density and logit effect; `page` draws them as an
  offline HTML page;
- `steer`: the hook functions that add a feature's direction (steering) or remove a feature.

Everything reads and writes the model through its hook points (`llmcli.model.hooks`).
"""
