"""`flashtriton env`: versions, devices, where the kernels run, which features each device supports, and why not.

Works without a GPU. collect_environment() returns plain data; format_environment() renders it as text.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

MIN_CAPABILITY = (8, 0)
OLD_GPU_REASON = "FlashAttention only supports Ampere GPUs or newer."

# Features of the dense API that every supported device runs.
DENSE_FEATURES = ("forward", "backward", "fp16", "bf16", "causal", "sliding window", "softcap", "ALiBi",
                  "GQA/MQA", "head dim 1..512", "V head dim apart from q's", "learnable sinks",
                  "deterministic backward", "dropout")
# Public functions of the flash_attn 2.x surface that may not be implemented yet.
OPTIONAL_FUNCTIONS = {"varlen": "flash_attn_varlen_func", "kv cache": "flash_attn_with_kvcache"}


@dataclass
class DeviceInfo:
    index: int
    name: str
    capability: str
    multiprocessors: int
    memory_gib: float
    supported: list = field(default_factory=list)
    unsupported: dict = field(default_factory=dict)     # feature -> reason


@dataclass
class Environment:
    versions: dict
    kernels_interpreted: bool
    cpu_path: str
    triton_cache_dir: str
    environment_variables: dict
    devices: list
    library_gaps: dict           # feature -> reason, on every device
    strict_checks: bool = False  # index values of GPU calls checked on the host (FLASHTRITON_STRICT)


def cuda_driver_version() -> Optional[str]:
    """The CUDA driver version ("12.8"), from torch when it exposes it, else from libcuda; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    getter = getattr(torch._C, "_cuda_getDriverVersion", None)
    try:
        code = getter() if getter else _libcuda_driver_version()
    except (OSError, RuntimeError, AttributeError):
        return None
    return f"{code // 1000}.{code % 1000 // 10}" if code else None


def _libcuda_driver_version() -> int:
    version = ctypes.c_int()
    ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
    return version.value


def triton_cache_dir() -> str:
    """triton.knobs.cache.dir, else TRITON_CACHE_DIR, else ~/.triton/cache."""
    try:
        import triton

        return str(triton.knobs.cache.dir)
    except (ImportError, AttributeError):
        return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def implemented_optional_features() -> list:
    """The OPTIONAL_FUNCTIONS features this flashtriton provides."""
    import flashtriton

    return [feature for feature, name in OPTIONAL_FUNCTIONS.items() if hasattr(flashtriton, name)]


def library_gaps() -> dict:
    """Features flashtriton does not implement yet, on any device, with the reason."""
    import flashtriton

    gaps = {}
    for feature, name in OPTIONAL_FUNCTIONS.items():
        if not hasattr(flashtriton, name):
            gaps[feature] = f"flashtriton.{name} is not implemented yet"
    return gaps


def device_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    capability = (props.major, props.minor)
    info = DeviceInfo(index, props.name, f"{props.major}.{props.minor} (sm_{props.major}{props.minor})",
                      props.multi_processor_count, round(props.total_memory / 2**30, 1))
    if capability >= MIN_CAPABILITY:
        info.supported = list(DENSE_FEATURES) + implemented_optional_features()
        if props.major == 9:
            from . import configs
            from .ops import hopper

            if hopper.attn_fwd_hopper_kernel is None:
                info.unsupported["Gluon forward"] = "this Triton has no Gluon Hopper API; the Triton kernel runs"
            elif not (configs.GLUON_ALLOWED and configs.TMA_ALLOWED):
                info.unsupported["Gluon forward"] = "switched off (FLASHTRITON_GLUON=0 or FLASHTRITON_TMA=0)"
            else:
                info.supported.append("Gluon forward (dense, no window but causal, d64/128/256)")
            if hopper.attn_bwd_hopper_kernel is None:
                info.unsupported["Gluon backward"] = "this Triton's Gluon has no TMA reduction; the Triton kernels run"
            elif not (configs.GLUON_ALLOWED and configs.TMA_ALLOWED):
                info.unsupported["Gluon backward"] = "switched off (FLASHTRITON_GLUON=0 or FLASHTRITON_TMA=0)"
            else:
                info.supported.append("Gluon backward (dense, no window but causal, d64/128/256; "
                                      "deterministic at d128 (ordered dQ) and d256)")
    else:
        info.unsupported = {"every feature": OLD_GPU_REASON}
    return info


def cpu_path_description(kernels_interpreted: bool) -> str:
    if kernels_interpreted:
        return ("CPU tensors run the Triton kernels through Triton's interpreter (TRITON_INTERPRET=1 was set "
                "before flashtriton was imported); slow, for testing only.")
    return ("CPU tensors run the exact PyTorch reference in float32 (flashtriton.reference), not the Triton "
            "kernels. Set TRITON_INTERPRET=1 before importing flashtriton to run the kernels in Triton's interpreter.")


def collect_environment() -> Environment:
    import numpy
    import triton

    from . import __version__
    from .ops import backend, checks

    versions = {
        "flashtriton": __version__,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "numpy (Triton's interpreter)": numpy.__version__,
        "python": platform.python_version(),
        "CUDA runtime (torch.version.cuda)": torch.version.cuda,
        "CUDA driver": cuda_driver_version(),
    }
    devices = [device_info(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    variables = {name: os.environ.get(name) for name in ("TRITON_INTERPRET", "TRITON_CACHE_DIR", "FLASHTRITON_TMA",
                                                         "FLASHTRITON_GLUON", "FLASHTRITON_STRICT",
                                                         "CUDA_VISIBLE_DEVICES")}
    return Environment(versions, backend.KERNELS_INTERPRETED, cpu_path_description(backend.KERNELS_INTERPRETED),
                       triton_cache_dir(), variables, devices, library_gaps(), checks.strict_checks_enabled())


def environment_dict(env: Environment) -> dict:
    return asdict(env)


def format_environment(env: Environment) -> str:
    lines = ["Versions:"]
    lines += [f"  {name}: {value if value is not None else 'n/a'}" for name, value in env.versions.items()]
    lines.append(f"Python executable: {sys.executable}")
    lines.append(f"Kernels interpreted (TRITON_INTERPRET=1 at import): {'yes' if env.kernels_interpreted else 'no'}")
    lines.append(f"Triton cache dir: {env.triton_cache_dir}")
    lines.append(f"Strict index checks on GPU calls (FLASHTRITON_STRICT=1, flashtriton.set_strict_checks): "
                 f"{'on' if env.strict_checks else 'off'}")
    variables = [f"{name}={value}" for name, value in env.environment_variables.items() if value is not None]
    lines.append(f"Environment variables: {', '.join(variables) or 'none of ' + ', '.join(env.environment_variables)}")
    if not env.devices:
        lines.append("CUDA devices: none (torch.cuda.is_available() is False)")
    for dev in env.devices:
        lines.append(f"CUDA device {dev.index}: {dev.name}, compute capability {dev.capability}, "
                     f"{dev.multiprocessors} SMs, {dev.memory_gib} GiB")
        if dev.supported:
            lines.append(f"  supported: {', '.join(dev.supported)}")
        for feature, reason in dev.unsupported.items():
            lines.append(f"  unsupported: {feature}: {reason}")
    lines.append(f"CPU: {env.cpu_path}")
    lines.append("Not implemented on any device:")
    lines += [f"  {feature}: {reason}" for feature, reason in env.library_gaps.items()]
    return "\n".join(lines)
