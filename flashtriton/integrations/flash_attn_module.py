"""`flashtriton.install_as_flash_attn()`: `import flash_attn` resolves to flashtriton in this process.

The wheel ships no top-level `flash_attn` package (it would clash with a real installation); the modules exist
only in `sys.modules` once installed (docs/api.md §10):

    flash_attn                          __version__ and the seven public functions, as upstream's __init__
    flash_attn.flash_attn_interface     flashtriton.flash_attn_interface (public, autograd and _flash_attn_* names)
    flash_attn.bert_padding             flashtriton.bert_padding
    flash_attn.layers.rotary            flashtriton.layers.rotary
    flash_attn.ops.triton.rotary        flashtriton.ops.triton.rotary

`flash_attn`, `flash_attn.layers`, `flash_attn.ops` and `flash_attn.ops.triton` are packages with an empty
__path__: importing any other `flash_attn.*` module raises ModuleNotFoundError, and no file of a real flash_attn
installed beside us is ever loaded against these modules.

- A real flash_attn already imported (a `flash_attn` or `flash_attn.*` entry in sys.modules that is not ours):
  RuntimeError; two implementations in one process would mix tensors of both.
- A real flash_attn installed but not imported: it is shadowed for this process (sys.modules is searched before
  the import path). `importlib.metadata.version("flash_attn")` still reports the installed distribution: only
  the modules are replaced.
- Calling it again returns the same module.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import threading
import types
from typing import Dict

_MARK = "__flashtriton__"
_PUBLIC = ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache")
# flash_attn module name -> the flashtriton module it is.
_ALIASES = {
    "flash_attn.flash_attn_interface": "flashtriton.flash_attn_interface",
    "flash_attn.bert_padding": "flashtriton.bert_padding",
    "flash_attn.layers.rotary": "flashtriton.layers.rotary",
    "flash_attn.ops.triton.rotary": "flashtriton.ops.triton.rotary",
}
_PACKAGES = ("flash_attn", "flash_attn.layers", "flash_attn.ops", "flash_attn.ops.triton")
_lock = threading.Lock()


def _is_ours(module) -> bool:
    return getattr(module, _MARK, False) or getattr(module, "__name__", "") in _ALIASES.values()


def _foreign_modules() -> Dict[str, str]:
    """{name: where it came from} of flash_attn modules in sys.modules that flashtriton did not put there."""
    found = {}
    for name, module in list(sys.modules.items()):
        if (name == "flash_attn" or name.startswith("flash_attn.")) and module is not None and not _is_ours(module):
            found[name] = getattr(module, "__file__", None) or repr(module)
    return found


def _package(name: str, doc: str) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__path__ = []
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__package__ = name
    setattr(module, _MARK, True)
    return module


def install_as_flash_attn() -> types.ModuleType:
    """Make `import flash_attn` and the flash_attn submodules listed in this module's docstring resolve to
    flashtriton in this process; returns the `flash_attn` module. Code written against flash_attn 2.x then runs
    unchanged (`from flash_attn import flash_attn_func`, `from flash_attn.flash_attn_interface import
    _flash_attn_forward`, ...). Idempotent. Raises RuntimeError when a real flash_attn is already imported."""
    with _lock:
        foreign = _foreign_modules()
        if foreign:
            listed = ", ".join(f"{name} ({origin})" for name, origin in sorted(foreign.items()))
            raise RuntimeError(
                "flashtriton.install_as_flash_attn(): a flash_attn that is not flashtriton is already imported in "
                f"this process: {listed}. Call install_as_flash_attn() before anything imports flash_attn, or use "
                "that flash_attn instead.")
        if all(_is_ours(sys.modules.get(name)) for name in (*_PACKAGES, *_ALIASES)):
            return sys.modules["flash_attn"]

        import flashtriton

        leaves = {name: importlib.import_module(target) for name, target in _ALIASES.items()}
        modules = {name: _package(name, f"flashtriton's stand-in for {name} (flashtriton.install_as_flash_attn).")
                   for name in _PACKAGES}
        top = modules["flash_attn"]
        top.__version__ = flashtriton.__version__
        for name in _PUBLIC:
            setattr(top, name, getattr(flashtriton, name))
        modules.update(leaves)
        for name, module in modules.items():
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(modules[parent], child, module)
        sys.modules.update(modules)
        return top
