"""cProfile of a process's first flashtriton call on CUDA and, with --steady N, host time per warm eager call.

    python tools/profile_first_call.py [--head-dim 128] [--top 35] [--steady 0]

CUDA is initialised and one unrelated kernel is run first, so the profile holds only what the first
flash_attn_func call adds: Triton's cache lookup / compilation, launcher loading, flashtriton's checks. Run it once
with an empty TRITON_CACHE_DIR and once with a warm one to separate compilation from the rest. --steady N times N
warm calls of each kind (inference forward, training step, backward alone, decode) and profiles them.
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
    from flashtriton.bench import host_us_per_call

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
        print(f"{label}: host time per call {host_us_per_call(call, calls):.1f} us")
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            call()
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    main()
