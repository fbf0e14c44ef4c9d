"""`pp-runtime plan`: the best deployment of a model on a cluster for a workload and an SLO,
and the Pareto frontier of throughput per GPU against latency.

space.py    the layouts (tp x pp x replicas) and knobs, and what memory or the TBT SLO rule out
probe.py    one candidate at one rate on the simulator: early stop, the on-disk cache
record.py   what a probe records of its simulation, and the summary it reports
search.py   each layout's capacity (fast or exhaustive)
runner.py   the worker processes, and the fast path's steps as each layout's are ready
calibrated.py  the profile's calibration of each layout (--profile), measured where missing
frontier.py each layout's best point, the Pareto set, its configs and figure
report.py   the ranked table, why each layout lost, the capacity-latency plot, the winner's config
validate.py the top choices and a reference run for real on this machine's CPU pipeline
cli/plan.py the flags and the run (docs/plan.md)
"""
