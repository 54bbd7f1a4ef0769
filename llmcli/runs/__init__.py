"""The run directory: what its files hold and how they are read safely (`formats`), its life
from a fresh start or a resume through each save (`directory`), loading a run for readers
(`loading`), the metrics log (`metrics`), the per-head grids of each evaluation
(`head_metrics`), trackers (`trackers`), recorded versions (`versions`), and reading runs
(`info`, `compare`)."""
