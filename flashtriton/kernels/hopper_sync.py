"""Synchronisation helpers shared by the Gluon Hopper kernels (kernels/fwd_hopper.py, kernels/bwd_hopper.py)."""

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
    the same). Not for shared memory the warpgroup's threads wrote with plain stores: those need the barrier."""
    mbarrier.expect(barrier, 0, pred=pred)
