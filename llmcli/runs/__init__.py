"""The run directory: its files (`checkpoint`), the metrics log (`metrics`), trackers
(`trackers`), recorded versions (`versions`), and reading runs (`info`, `compare`)."""
