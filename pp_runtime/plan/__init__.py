"""`pp-runtime plan`: the best deployment of a model on a cluster for a workload and an SLO.

space.py    the layouts (tp x pp x replicas) and knobs, and what memory or the TBT SLO rule out
search.py   each candidate's capacity on the simulator, best bound first, in parallel processes
report.py   the ranked table, why each layout lost, the capacity-latency plot, the winner's config
validate.py the top choices and a reference run for real on this machine's CPU pipeline
command.py  the flags and the run (docs/plan.md)
"""
