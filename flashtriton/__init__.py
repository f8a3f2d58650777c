"""flashtriton: the flash_attn 2.x API with Triton kernels. Use as `import flashtriton as flash_attn`, or call
`flashtriton.install_as_flash_attn()` once so that code importing `flash_attn` runs unchanged."""

from pkgutil import extend_path

# Subpackages installed separately under flashtriton/ (as flash_attn.cute is beside flash_attn) import through us.
__path__ = extend_path(__path__, __name__)


def _read_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flashtriton")
    except PackageNotFoundError:
        return "2.8.3.1"


__version__ = _read_version()

from .interface import (  # noqa: E402,F401
    flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from .integrations.flash_attn_module import install_as_flash_attn  # noqa: E402,F401
from .ops.checks import set_strict_checks, strict_checks, strict_checks_enabled  # noqa: E402,F401

from .integrations import sdpa as _sdpa  # noqa: E402

# Registers "flashtriton" with torch.nn.attention's flash attention registry when torch has one (>= 2.11); torch's
# providers register at import and leave activation (activate_flash_attention_impl) to the user.
_sdpa.register()
