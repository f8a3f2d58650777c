"""`flash_attn.flash_attn_interface` compatibility path: public functions, autograd classes, low-level ops."""

from .interface import (  # noqa: F401
    flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from .ops.autograd import (FlashAttnFunc, FlashAttnKVPackedFunc, FlashAttnQKVPackedFunc,  # noqa: F401
                           FlashAttnVarlenFunc, FlashAttnVarlenKVPackedFunc, FlashAttnVarlenQKVPackedFunc,
                           maybe_contiguous)
from .ops.backend import round_multiple  # noqa: F401
from .ops.library import (_flash_attn_backward, _flash_attn_forward, _flash_attn_varlen_backward,  # noqa: F401
                          _flash_attn_varlen_forward)

_wrapped_flash_attn_forward = _flash_attn_forward
_wrapped_flash_attn_backward = _flash_attn_backward
_wrapped_flash_attn_varlen_forward = _flash_attn_varlen_forward
_wrapped_flash_attn_varlen_backward = _flash_attn_varlen_backward
