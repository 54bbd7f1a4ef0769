"""`llmcli bench`: speed and memory of a config across head counts and sequence lengths.

`measure` (each `(n_head, context_length)` combination measured, in a fresh process by default)
-> `report` (the results as a table, `bench.json` and `bench.png`; `bench_and_report`, what the
command runs).
"""
