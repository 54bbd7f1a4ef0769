"""Training: the loop (`loop`), its loss estimate (`evaluate`), its resume state (`state`),
optimizers and schedules (`optim`, `muon`), precision (`precision`), memory checks (`memory`),
several processes (`distributed`) and Ctrl-C / SIGTERM (`interrupt`)."""
