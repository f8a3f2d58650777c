"""Synchronisation helpers shared by the Gluon Hopper kernels (kernels/fwd_hopper.py, bwd_hopper.py and
bwd_hopper_d256.py)."""

from triton.experimental import gluon
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def arrive_after_wgmma(barrier, pred=True):
    """One arrival on `barrier` (by one thread of the calling warpgroup) handing back shared memory that only the
    warpgroup's wgmmas read, once the caller waited for them (or, for a turn barrier, issued them): an arrival that
    expects zero bytes. mbarrier.arrive arrives the same way but after a warpgroup-wide BAR.SYNC (Triton 3.6's
    barrier pass orders every shared-memory access of the partition before an arrival, and the next barrier
    operation after it), which the forward paid four times per key block. A wgmma completes for its whole
    warpgroup, so the thread that waited for it may arrive alone (CUTLASS's clustered consumer release relies on
    the same). Not for shared memory the warpgroup's threads also read or wrote with plain loads / stores, unless
    a warpgroup barrier (gl.thread_barrier) follows the last of those before the arrival (the backward's Q / dO
    stages: lse and delta are loaded by every thread, then the dS store's barrier)."""
    mbarrier.expect(barrier, 0, pred=pred)
