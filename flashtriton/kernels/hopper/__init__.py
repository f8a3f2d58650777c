"""Gluon kernels for Hopper (sm_90), warp-specialized: the dense forward (fwd.py), the d64 / d128 backward (bwd.py)
and the d256 dK / dV kernel (bwd_d256.py), with the helpers they share (common.py) and the forward's work items
(schedule.py) and tail merge (tail_merge.py). ops/hopper.py launches them."""
