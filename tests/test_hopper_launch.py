"""The Gluon launchers' arguments against the Gluon kernels' signatures, on CPU (no GPU, no launch).

Gluon has no interpreter, so the CPU suite never launches these kernels; a launcher that passes one argument too
many or too few would only fail on a Hopper GPU. Here ops/hopper's launchers run on CPU tensors in a process where
Triton compiles instead of interpreting (the kernels import there), with every kernel replaced by a recorder that
binds the launch's arguments to the kernel's signature (inspect.Signature.bind: a missing or extra argument raises).
"""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import inspect
    import torch
    from flashtriton.ops import hopper
    from flashtriton.scores import score_params

    if hopper.attn_fwd_hopper_kernel is None or hopper.attn_bwd_hopper_kernel is None:
        print("no Gluon Hopper API")
        raise SystemExit(3)
    hopper._multiprocessors = lambda device: 132
    bound = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                arguments = inspect.signature(self.kernel.fn).bind(*args, **kwargs).arguments
                bound.append((self.kernel.fn.__name__, arguments))
            return launch

    for name in ("attn_fwd_hopper_kernel", "attn_fwd_hopper_d512_kernel", "attn_tail_merge_kernel",
                 "attn_bwd_hopper_kernel", "attn_bwd_hopper_d256_kernel", "attn_bwd_hopper_dq_kernel"):
        setattr(hopper, name, Recorder(getattr(hopper, name)))

    def tensors(*shapes):
        return [torch.randn(*shape, dtype=torch.bfloat16) for shape in shapes]

    # dense forwards: causal, full, full at d256 (a cut tail at 132 programs: the tail merge), ALiBi, a head dim on
    # wider tiles, V's own head dim; the causal ones with dropout, V's own head dim with sinks
    for head_dim, head_dim_v, causal, alibi in ((128, 128, True, False), (128, 128, False, False),
                                                (256, 256, False, False), (64, 64, True, True), (96, 96, True, False),
                                                (192, 128, False, False)):
        q, k, v = tensors((1, 8192, 4, head_dim), (1, 8192, 2, head_dim), (1, 8192, 2, head_dim_v))
        out, lse = torch.empty(1, 8192, 4, head_dim_v, dtype=q.dtype), torch.empty(1, 4, 8192)
        hopper.launch_fwd(q, k, v, out, lse, (lse.stride(0), lse.stride(1)), score_params(0.1, causal, -1, -1, 0.0,
                          8192), 8192, 8192, 1, 4, alibi_slopes=torch.rand(4) if alibi else None,
                          dropout_p=0.1 if causal else 0.0, rng_state=torch.zeros(2, dtype=torch.int64),
                          learnable_sink=torch.randn(4) if head_dim_v != head_dim else None)
    # head dim 512 on the split tiles, causal, GQA
    q, k, v = tensors((2, 1000, 4, 512), (2, 1000, 2, 512), (2, 1000, 2, 512))
    lse = torch.empty(2, 4, 1000)
    hopper.launch_fwd(q, k, v, torch.empty_like(q), lse, (lse.stride(0), lse.stride(1)),
                      score_params(0.1, True, -1, -1, 0.0, 1000), 1000, 1000, 2, 4)
    # a varlen forward with a local window
    cu = torch.tensor([0, 300, 700], dtype=torch.int32)
    q, k, v = tensors((700, 4, 128), (700, 2, 128), (700, 2, 128))
    hopper.launch_fwd(q, k, v, torch.empty_like(q), torch.empty(4, 700), (0, 700),
                      score_params(0.1, True, 50, 0, 0.0, 400), 400, 400, 2, 4, cu, cu)
    # an FP8 forward: e4m3 q and k, fp16 v (the launcher's caller widens it), bf16 out, (B, Hk) descales
    q8, k8 = (t.to(torch.float8_e4m3fn) for t in tensors((2, 1000, 4, 128), (2, 1000, 2, 128)))
    v16 = tensors((2, 1000, 2, 128))[0].half()
    lse = torch.empty(2, 4, 1000)
    hopper.launch_fwd(q8, k8, v16, torch.empty(2, 1000, 4, 128, dtype=torch.bfloat16), lse,
                      (lse.stride(0), lse.stride(1)), score_params(0.1, True, -1, -1, 0.0, 1000), 1000, 1000, 2, 4,
                      descales=tuple(torch.rand(2, 2) for _ in range(3)))
    # backwards: each division (d64, d128 ordered, d256, d96 and d192 in two chunks) and a window; dropout where the
    # kernel takes it
    for head_dim, window, deterministic in ((128, (-1, -1), True), (64, (20, 5), False), (256, (-1, -1), False),
                                            (96, (-1, -1), False), (192, (-1, -1), False)):
        q, k, v, dout = tensors(*[(2, 500, 2, head_dim)] * 4)
        lse, delta = torch.empty(2, 2, 512), torch.empty(2, 2, 512)
        dq_accum = torch.zeros(q.shape) if hopper.computes_dq(head_dim) else None
        hopper.launch_bwd(q, k, v, dout, lse, delta, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                          dq_accum, (lse.stride(0), lse.stride(1)), (delta.stride(0), delta.stride(1)),
                          score_params(0.1, False, *window, 0.0, 500), 500, 500, 2, 1, deterministic,
                          *((0.1, torch.zeros(2, dtype=torch.int64)) if hopper.backward_takes_logit_options(head_dim)
                            else (0.0, None)),
                          alibi_slopes=torch.rand(2, 2) if hopper.backward_takes_logit_options(head_dim) else None)
    # the dK / dV only kernel with V's own head dim (MLA-style): (192, 128) causal, (256, 100) on 128-wide V tiles
    for head_dim, head_dim_v in ((192, 128), (256, 100)):
        q, k, dout = tensors((2, 500, 4, head_dim), (2, 500, 2, head_dim), (2, 500, 4, head_dim_v))
        v = tensors((2, 500, 2, head_dim_v))[0]
        lse, delta = torch.empty(2, 4, 512), torch.empty(2, 4, 512)
        hopper.launch_bwd(q, k, v, dout, lse, delta, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                          None, (lse.stride(0), lse.stride(1)), (delta.stride(0), delta.stride(1)),
                          score_params(0.1, True, -1, -1, 0.0, 500), 500, 500, 2, 1, False)
    # the Gluon dQ kernel after the dK / dV one: head dim 192 (two chunks), 160 on its tiles, GQA and a window,
    # V's own head dim (192, 128)
    for head_dim, head_dim_v, window in ((192, 192, (-1, -1)), (160, 160, (30, 0)), (192, 128, (-1, -1))):
        q, dout = tensors((2, 500, 4, head_dim), (2, 500, 4, head_dim_v))
        k, v = tensors((2, 500, 2, head_dim), (2, 500, 2, head_dim_v))
        lse, delta = torch.empty(2, 4, 512), torch.empty(2, 4, 512)
        hopper.launch_bwd_dq(q, k, v, dout, lse, delta, torch.empty_like(q), (lse.stride(0), lse.stride(1)),
                             (delta.stride(0), delta.stride(1)), score_params(0.1, True, *window, 0.0, 500), 500, 500,
                             2, 1)
    # a varlen backward: (T, H, D) tensors, (H, T) lse / delta, head dims 128 and 96 (two chunks)
    for head_dim in (128, 96):
        q, k, v, dout = tensors((700, 4, head_dim), (650, 2, head_dim), (650, 2, head_dim), (700, 4, head_dim))
        lse, delta = torch.empty(4, 700), torch.empty(4, 700 + 256)
        hopper.launch_bwd(q, k, v, dout, lse, delta, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                          torch.zeros(q.shape), (0, lse.stride(0)), (0, delta.stride(0)),
                          score_params(0.1, True, -1, -1, 0.0, 400), 400, 400, 2, 2, False,
                          cu_seqlens_q=torch.tensor([0, 300, 700]), cu_seqlens_k=torch.tensor([0, 250, 650]))
    for name, arguments in bound:
        print(name, *(f"{key}={len(value)}" for key, value in arguments.items() if isinstance(value, tuple)))
''')


def test_launchers_bind_to_the_kernel_signatures():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if done.returncode == 3:
        pytest.skip("this Triton has no Gluon Hopper API with TMA reductions")
    assert done.returncode == 0, done.stderr[-3000:]
    launches = done.stdout.splitlines()
    kernels = [line.split()[0] for line in launches]
    assert kernels.count("attn_fwd_hopper_kernel") == 8 and kernels.count("attn_fwd_hopper_d512_kernel") == 1, launches
    assert kernels.count("attn_tail_merge_kernel") >= 1, launches
    assert kernels.count("attn_bwd_hopper_kernel") == 5 and kernels.count("attn_bwd_hopper_d256_kernel") == 4, launches
    assert kernels.count("attn_bwd_hopper_dq_kernel") == 3, launches
    backward = [line for line in launches if line.startswith("attn_bwd_hopper_kernel ")]
    assert all("varlen=8" in line and "alibi_args=3" in line for line in backward), backward
    # the grouped arguments reach the kernels whole: the forward's varlen (6 entries), ALiBi's (4)
    assert all("varlen=6" in line and "alibi_args=4" in line and "fp8_args=4" in line
               for line in launches if line.startswith("attn_fwd_hopper_kernel "))
