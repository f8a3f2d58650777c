"""`flash_attn.flash_attn_interface` compatibility path: public functions, autograd classes, low-level ops."""

from .interface import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func  # noqa: F401
from .ops.autograd import (FlashAttnFunc, FlashAttnKVPackedFunc, FlashAttnQKVPackedFunc,  # noqa: F401
                           maybe_contiguous)
from .ops.backend import round_multiple  # noqa: F401
from .ops.library import _flash_attn_backward, _flash_attn_forward  # noqa: F401

_wrapped_flash_attn_forward = _flash_attn_forward
_wrapped_flash_attn_backward = _flash_attn_backward
