"""A run of the bundled runtime, after the fact: what it recorded and how that meets the plan.

`record` holds the files a run directory keeps (metrics.jsonl, segments.jsonl, summary.json,
plans/), written by plan3d/runtime and the launcher: measurements and identities only, never a
prediction. `compare` is the one place a prediction (the plan's estimate, or a fresh one for what
the run actually did) meets those measurements, with one sign convention: predicted / measured - 1.

Imports go one way: plan3d/runtime -> run.record <- run.compare -> plan3d.cost. This package's
__init__ imports neither module, so the runtime, which reads the record's format, never pulls in
the cost model.
"""
