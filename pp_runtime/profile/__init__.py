"""The profiler and the calibrator: what `pp-runtime profile` measures on this machine.

`measure.py` times the operations the cost model prices (mlp.csv, attention.csv), `p2p.py`
the stage-to-stage send/recv (send_recv.csv), on the runtime's own modules; `grid.py` is
the points and effort (plain data); `calibrate.py` runs the real executor briefly and
writes calibration.json. `costmodel/` reads what they write and never imports them: it
prices, this package measures (torch, model, worker, executors, engine).
"""
