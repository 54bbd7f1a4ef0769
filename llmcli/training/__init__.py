"""Training: one optimizer step (`step`) and the loop around it (`loop`), with its optimizers and
schedules (`optim`, `muon`) and precision (`precision`); a run and how it is built or restored
(`run`, `state`); the loop's named steps beside it: what keeps a step from harming the run
(`safeguards`, the spike guard `guard`, the layer watch `layers`), what it reads from the device
(`readout`) and writes (`records`), its loss estimate (`evaluate`); memory and batch sizes
(`memory`, `batch`, `plan`), several processes (`distributed`) and Ctrl-C / SIGTERM
(`interrupt`). docs/reading-the-code.md says which of them to read first."""
