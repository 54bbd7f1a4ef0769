"""Training: one optimizer step (`step`) and the loop around it (`loop`), with its optimizers and
schedules (`optim`, `muon`) and precision (`precision`); the run the loop works with and how it
is built (`build`), saved, restored and rolled back (`checkpoint`), what a save carries
(`state`: the loop's `counters` and every `rng` with it) and what the run is (`run_facts`);
beside the loop, each with a narrow job: the spike guard (`guard`) and the layer watch
(`layers`) as the step's `before_update`, what is read from the device and logged (`log`), the
loss estimate (`evaluate`); memory and batch sizes (`memory`, `batch`, `plan`), several
processes (`distributed`) and Ctrl-C / SIGTERM (`interrupt`). docs/reading-the-code.md says
which of them to read first."""
