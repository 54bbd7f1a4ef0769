"""Training: a run and how it is built or restored (`run`), the loop (`loop`), its loss estimate
and in-context learning score (`evaluate`), its resume state (`state`), optimizers and schedules
(`optim`, `muon`), precision (`precision`), memory checks (`memory`), several processes
(`distributed`) and Ctrl-C / SIGTERM (`interrupt`)."""
