"""Gluon kernels for Hopper (sm_90), warp-specialized: the dense forward (fwd.py), the backward up to head dim 128
(bwd.py), the dK / dV kernel at 192 and 256 (bwd_d256.py) and the dQ kernel that follows it at 192 (bwd_dq.py), with
the helpers they share (common.py) and the forward's work items (schedule.py) and tail merge (tail_merge.py).
ops/hopper.py launches them."""
