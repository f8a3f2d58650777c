"""Where the first flashtriton call of a process spends its time (issue #5 cold start), on CUDA, and with
--steady N where N later calls spend their host time (eager per-call overhead: inference forward, training step
(forward through autograd + backward), backward alone, decode).

    python tools/profile_first_call.py [--head-dim 128] [--top 35] [--steady 0]

CUDA is initialised and one unrelated kernel is run first, so the profile holds only what the first
flash_attn_func call adds: Triton's cache lookup / compilation, launcher loading, our checks. Run it once with
an empty TRITON_CACHE_DIR and once with a warm one to separate compilation from the rest.
"""

import argparse
import cProfile
import pstats
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--steady", type=int, default=0, help="also profile this many warm calls (host time)")
    args = parser.parse_args()

    torch.zeros(1, device="cuda").add_(1)
    torch.cuda.synchronize()
    import flashtriton

    q, k, v = (torch.randn(2, 512, 8, args.head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    flashtriton.flash_attn_func(q, k, v, causal=True)
    torch.cuda.synchronize()
    profiler.disable()
    first = time.perf_counter() - start
    start = time.perf_counter()
    flashtriton.flash_attn_func(q, k, v, causal=True)
    torch.cuda.synchronize()
    second = time.perf_counter() - start
    print(f"first call {first:.3f} s, second call {second * 1e3:.2f} ms")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.top)
    if args.steady:
        profile_steady(flashtriton, q, k, v, args.steady, args.top)


def profile_steady(flashtriton, q, k, v, calls: int, top: int) -> None:
    """Host time per warm call (no synchronization inside the loop), then the profile of the same loop."""
    from flashtriton.testing import forced_gluon_forward

    for causal in (False, True):
        flashtriton.flash_attn_func(q, k, v, causal=causal)
    torch.cuda.synchronize()
    # the training path: the forward through autograd, then the backward (the Gluon backward where it covers the call)
    q_grad, k_grad, v_grad = (x.detach().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)
    graph = flashtriton.flash_attn_func(q_grad, k_grad, v_grad, causal=True)

    def training_step():
        out = flashtriton.flash_attn_func(q_grad, k_grad, v_grad, causal=True)
        return torch.autograd.grad(out, (q_grad, k_grad, v_grad), dout)

    for label, call in (("forward", lambda: flashtriton.flash_attn_func(q, k, v, causal=True)),
                        ("training step (fwd+bwd)", training_step),
                        ("backward", lambda: torch.autograd.grad(graph, (q_grad, k_grad, v_grad), dout,
                                                                 retain_graph=True)),
                        ("decode", lambda: flashtriton.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=400))):
        print(f"{label}: host time per call {host_time(call, calls):.1f} us")
        if label == "forward":
            with forced_gluon_forward(False):
                print_forward_breakdown(flashtriton, q, k, v, calls)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            call()
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def host_time(call, calls: int) -> float:
    """Microseconds of host time per call of call() (warm, no synchronization inside the loop)."""
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return host * 1e6


def print_forward_breakdown(flashtriton, q, k, v, calls: int) -> None:
    """The causal forward's host time by layer: public function, op without autograd, the bare Triton launch
    (arguments captured from one call and replayed), building the four host tensor descriptors, and the
    three allocations of a call. Measures the Triton kernel's path (the Gluon Hopper forward is switched off
    for it: its launch is not the one replayed here)."""
    from flashtriton.ops import backend

    captured = {}
    kernel = backend.attn_fwd_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                captured.update(grid=grid, args=args, kwargs=kwargs)
                return kernel[grid](*args, **kwargs)
            return launch

    backend.attn_fwd_kernel = Recorder()
    try:
        flashtriton.flash_attn_func(q, k, v, causal=True)
    finally:
        backend.attn_fwd_kernel = kernel
    grid, args, kwargs = captured["grid"], captured["args"], captured["kwargs"]
    scale = q.shape[-1] ** -0.5
    rows = {
        "flash_attn_func": lambda: flashtriton.flash_attn_func(q, k, v, causal=True),
        "backend.mha_fwd (no autograd)": lambda: backend.mha_fwd(q, k, v, 0.0, scale, True, -1, 0, 0.0, None, False),
        "Triton launch, captured args": lambda: kernel[grid](*args, **kwargs),
        "4 host tensor descriptors": lambda: [backend._row_descriptor(t, 64, 128) for t in (q, k, v, q)],
        "torch.empty x2 + torch.zeros": lambda: (torch.empty_like(q), torch.empty(2, 8, 512, device=q.device),
                                                 torch.zeros(2, dtype=torch.int64, device=q.device)),
    }
    for name, call in rows.items():
        print(f"  {name}: {host_time(call, calls):.1f} us")


if __name__ == "__main__":
    main()
