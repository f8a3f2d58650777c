"""The smallest warp-specialized Gluon kernel shaped like kernels/hopper/fwd.py (a 4-warp default partition, a 4-warp
and a 1-warp worker, setmaxnreg 232 / 24) that touches no shared memory of its own: what compute-sanitizer's
racecheck reports on it comes from Triton's warp-specialization lowering (the partition state and captured
arguments it passes through shared memory), not from a kernel's own buffers.

    compute-sanitizer --tool racecheck python tools/ws_racecheck_probe.py [--mbarrier]

--mbarrier also initializes one mbarrier before warp_specialize and has the default partition arrive on it, as
kernels/hopper/fwd.py does (the default partition's prologue then synchronizes its own 128 threads on named
barrier 0 after the init). Prints `ok` when every partition of every program ran (needs an sm_90 GPU, TRITON_INTERPRET unset).
"""

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def _partition(out, slot, value):
    gl.store(out + slot, value)


@gluon.jit
def _arriving_partition(out, slot, value, bar):
    mbarrier.arrive(bar)
    gl.store(out + slot, value)


@gluon.jit
def ws_probe_kernel(out, WITH_MBARRIER: gl.constexpr, num_warps: gl.constexpr):
    first = gl.program_id(0) * 3
    if WITH_MBARRIER:
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        gl.warp_specialize([(_arriving_partition, (out, first, first + 1, bar)),
                            (_partition, (out, first + 1, first + 2)), (_partition, (out, first + 2, first + 3))],
                           [4, 1], [232, 24])
    else:
        gl.warp_specialize([(_partition, (out, first, first + 1)), (_partition, (out, first + 1, first + 2)),
                            (_partition, (out, first + 2, first + 3))], [4, 1], [232, 24])


def main() -> int:
    programs = 264  # two waves on a 132-SM H200
    out = torch.zeros(3 * programs, dtype=torch.int32, device="cuda")
    ws_probe_kernel[(programs,)](out, WITH_MBARRIER="--mbarrier" in sys.argv[1:], num_warps=4)
    expected = torch.arange(1, 3 * programs + 1, dtype=torch.int32, device="cuda")
    ok = bool(torch.equal(out, expected))
    print("ok" if ok else f"FAIL: {int((out != expected).sum())} partitions did not run")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
