"""Attribution graphs over transcoder features, as circuit-tracer defines them (Ameisen et al.
2025, "Circuit Tracing: Revealing Computational Graphs in Language Models"): `llmcli graph`.

The modules, bottom to top:

- `replacement`: the local replacement model of one prompt (transcoders and error terms in
  place of the MLPs, attention patterns and norm denominators frozen), made of the run's own
  forward at its hook points;
- `attribute`: the graph's nodes and edges (direct effects), with its exactness identities
  checked as it is made, and the `graph.pt` fields of circuit-tracer's `Graph.to_pt`;
- `prune`: node and edge influence, and pruning with circuit-tracer's thresholds;
- `paths`: each node's label and the heaviest paths into each logit (`--json`);
- `page`: the pruned graph as a page of the offline viewer;
- `frontend`: the JSON circuit-tracer's `create_graph_files` writes, from the same graph;
- `command`: `llmcli graph`: the run, transcoders and prompt checked, the graph and its files.
"""
