"""API surface of the dense half (docs/api.md §1, §2.7-2.9, §3.1-3.3, §7, §10): signatures, exports, return
structures, autograd plumbing, low-level ops and torch.compile. Numerics are checked elsewhere in depth;
here they are only compared with the reference where a structural test also produces values."""

import ast
import dataclasses
import importlib.metadata
import inspect
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

import flashtriton as flash_attn
import flashtriton.flash_attn_interface as fai
from flashtriton.testing import (Case, assert_compiled_matches_eager, compare_with_reference, cu_seqlens, make_case_inputs,
                                 poisoned_outputs)

# ------------------------------------------------------------------------------------------------------------
# Signature parity. Each entry is the parameter list copied verbatim from docs/api.md; add rows as functions land.
# ------------------------------------------------------------------------------------------------------------

PUBLIC_SIGNATURES = {
    # §3.1
    "flash_attn_func": """q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                deterministic=False, return_attn_probs=False""",
    # §3.2
    "flash_attn_qkvpacked_func": """qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                          deterministic=False, return_attn_probs=False""",
    # §3.3
    "flash_attn_kvpacked_func": """q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                         deterministic=False, return_attn_probs=False""",
    # §3.4
    "flash_attn_varlen_func": """q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       dropout_p=0.0, softmax_scale=None, causal=False,
                       window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                       deterministic=False, return_attn_probs=False, block_table=None""",
    # §3.5
    "flash_attn_varlen_qkvpacked_func": """qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                 softmax_scale=None, causal=False, window_size=(-1, -1),
                                 softcap=0.0, alibi_slopes=None, deterministic=False,
                                 return_attn_probs=False""",
    # §3.6
    "flash_attn_varlen_kvpacked_func": """q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                causal=False, window_size=(-1, -1), softcap=0.0,
                                alibi_slopes=None, deterministic=False,
                                return_attn_probs=False""",
}

LOW_LEVEL_SIGNATURES = {
    # §7
    "_flash_attn_forward": """q, k, v, dropout_p, softmax_scale, causal,
                    window_size_left, window_size_right, softcap,
                    alibi_slopes, return_softmax""",
    "_flash_attn_backward": """dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                     softmax_scale, causal, window_size_left, window_size_right,
                     softcap, alibi_slopes, deterministic, rng_state=None""",
    "_flash_attn_varlen_forward": """q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p, softmax_scale, causal, window_size_left=-1,
                           window_size_right=-1, softcap=0.0, alibi_slopes=None,
                           return_softmax=False, block_table=None, leftpad_k=None,
                           seqused_k=None, zero_tensors=False, num_splits=0""",
    "_flash_attn_varlen_backward": """dout, q, k, v, out, softmax_lse, dq, dk, dv,
                            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            dropout_p, softmax_scale, causal, window_size_left,
                            window_size_right, softcap, alibi_slopes, deterministic,
                            rng_state=None, zero_tensors=False""",
}

REQUIRED = inspect.Parameter.empty


def _spec_parameters(spec: str):
    """[(name, default or REQUIRED)] of a parameter list written as Python source."""
    args = ast.parse(f"def f({spec}): pass").body[0].args
    defaults = [REQUIRED] * (len(args.args) - len(args.defaults)) + [ast.literal_eval(d) for d in args.defaults]
    return [(a.arg, d) for a, d in zip(args.args, defaults)]


def _op_schema_parameters(fn):
    """[(name, default)] of the operator schema a torch.library custom op parses its arguments with.

    Objects made by torch.library.custom_op report (*args, **kwargs) to inspect (upstream's do too); what
    callers see when they pass arguments by name is the schema of the registered operator.
    """
    schema = fn._opoverload._schema
    return [(a.name, a.default_value if a.has_default_value() else REQUIRED) for a in schema.arguments]


@pytest.mark.parametrize("module", [flash_attn, fai], ids=["flashtriton", "flash_attn_interface"])
@pytest.mark.parametrize("name", sorted(PUBLIC_SIGNATURES))
def test_public_signature_matches_spec(module, name):
    params = list(inspect.signature(getattr(module, name)).parameters.values())
    positional = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == _spec_parameters(PUBLIC_SIGNATURES[name])
    # Only keyword-only extras may follow the FA2 parameters (docs/api.md §3, §8); no *args / **kwargs.
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[len(positional):])


@pytest.mark.parametrize("prefix", ["", "_wrapped"])
@pytest.mark.parametrize("name", sorted(LOW_LEVEL_SIGNATURES))
def test_low_level_signature_matches_spec(name, prefix):
    """FA2's parameters in FA2's order; after them only the documented extensions, optional (docs/api.md §4.11)."""
    fn = getattr(fai, prefix + name)
    parameters, spec = _op_schema_parameters(fn), _spec_parameters(LOW_LEVEL_SIGNATURES[name])
    assert parameters[:len(spec)] == spec
    assert parameters[len(spec):] == LOW_LEVEL_EXTENSIONS.get(name, [])


# optional trailing parameters beyond FA2's (the forwards take learnable sinks and FP8 descales)
_FORWARD_EXTENSIONS = [("learnable_sink", None), ("q_descale", None), ("k_descale", None), ("v_descale", None)]
LOW_LEVEL_EXTENSIONS = {"_flash_attn_forward": _FORWARD_EXTENSIONS, "_flash_attn_varlen_forward": _FORWARD_EXTENSIONS}


def test_window_size_is_a_named_parameter():
    # transformers gates sliding windows on exactly this check (docs/api.md §3).
    assert "window_size" in inspect.signature(flash_attn.flash_attn_func).parameters


# ------------------------------------------------------------------------------------------------------------
# Module surface and version (docs/api.md §1, §10)
# ------------------------------------------------------------------------------------------------------------

DENSE_FUNCTIONS = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func"]
INTERFACE_EXTRAS = ["_flash_attn_forward", "_flash_attn_backward", "_wrapped_flash_attn_forward",
                    "_wrapped_flash_attn_backward", "maybe_contiguous", "round_multiple"]
AUTOGRAD_CLASSES = ["FlashAttnFunc", "FlashAttnQKVPackedFunc", "FlashAttnKVPackedFunc"]

# PEP 440 public version (canonical form) with an optional local label.
PEP440 = re.compile(r"^(?:[1-9][0-9]*!)?(?P<release>(?:0|[1-9][0-9]*)(?:\.(?:0|[1-9][0-9]*))*)"
                    r"(?:(?:a|b|rc)(?:0|[1-9][0-9]*))?(?:\.post(?:0|[1-9][0-9]*))?(?:\.dev(?:0|[1-9][0-9]*))?"
                    r"(?:\+[a-z0-9]+(?:\.[a-z0-9]+)*)?$")


def test_version_is_pep440_and_at_least_2_7():
    match = PEP440.match(flash_attn.__version__)
    assert match, flash_attn.__version__
    release = tuple(int(part) for part in match.group("release").split("."))
    assert release >= (2, 7, 0)


def test_version_equals_distribution_metadata():
    try:
        installed = importlib.metadata.version("flashtriton")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("flashtriton is imported from a source tree, not installed (no distribution metadata)")
    assert flash_attn.__version__ == installed


@pytest.mark.parametrize("name", DENSE_FUNCTIONS)
def test_package_and_interface_export_the_same_function(name):
    assert callable(getattr(flash_attn, name))
    assert getattr(flash_attn, name) is getattr(fai, name)


@pytest.mark.parametrize("name", INTERFACE_EXTRAS)
def test_interface_exports_compatibility_names(name):
    assert callable(getattr(fai, name))


@pytest.mark.parametrize("name", AUTOGRAD_CLASSES)
def test_interface_exports_autograd_classes(name):
    assert issubclass(getattr(fai, name), torch.autograd.Function)


def test_round_multiple_and_maybe_contiguous():
    assert [fai.round_multiple(x, 128) for x in (0, 1, 128, 129)] == [0, 128, 128, 256]
    strided = torch.zeros(4, 8)[:, ::2]
    assert fai.maybe_contiguous(strided).stride(-1) == 1
    dense = torch.zeros(4, 8)
    assert fai.maybe_contiguous(dense) is dense
    assert fai.maybe_contiguous(None) is None


def test_path_is_extended_for_sibling_distributions(tmp_path):
    # A separately installed flash_attn.cute-style subpackage must be importable through our __path__.
    sibling = tmp_path / "flashtriton" / "cute"
    sibling.mkdir(parents=True)
    (sibling / "__init__.py").write_text("MARKER = 'sibling'\n")
    package_parent = Path(flash_attn.__file__).resolve().parent.parent
    code = ("import sys; sys.path.append(sys.argv[1]); import flashtriton, flashtriton.cute; "
            "print(flashtriton.cute.MARKER, callable(flashtriton.flash_attn_func))")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=package_parent, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["sibling", "True"]


# ------------------------------------------------------------------------------------------------------------
# The three dense entry points, driven from the same (q, k, v)
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    fn: Callable
    pack: Callable  # (q, k, v) -> the entry point's tensor arguments

    def leaves(self, q, k, v, requires_grad=True):
        return [t.detach().clone().requires_grad_(requires_grad) for t in self.pack(q, k, v)]


ENTRIES = {
    "func": Entry(flash_attn.flash_attn_func, lambda q, k, v: (q, k, v)),
    "qkvpacked": Entry(flash_attn.flash_attn_qkvpacked_func, lambda q, k, v: (torch.stack((q, k, v), dim=2),)),
    "kvpacked": Entry(flash_attn.flash_attn_kvpacked_func, lambda q, k, v: (q, torch.stack((k, v), dim=2))),
}

# Sq == Sk and H == Hk so that every entry point can take it; 40 is not a multiple of any block size.
SELF_CASE = Case(batch=2, seqlen_q=40, seqlen_k=40, num_heads=2, num_heads_k=2, head_dim=32)
# Cross-attention with GQA, for the entry points that allow it.
GQA_CASE = Case(batch=2, seqlen_q=24, seqlen_k=40, num_heads=4, num_heads_k=2, head_dim=32, causal=True)


def _inputs(case=SELF_CASE):
    q, k, v, _ = make_case_inputs(case)
    return q, k, v


def _assert_close_to_reference(case, out, lse, q, k, v, grads=None, dout=None):
    checks = compare_with_reference(case, out, lse, q, k, v, None, grads=grads, dout=dout)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


@pytest.mark.parametrize("entry", ENTRIES)
def test_return_attn_probs_false_returns_a_tensor(entry):
    q, k, v = _inputs()
    out = ENTRIES[entry].fn(*ENTRIES[entry].pack(q, k, v))
    assert type(out) is torch.Tensor
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device


@pytest.mark.parametrize("entry", ENTRIES)
def test_return_attn_probs_true_returns_out_lse_and_empty_s_dmask(entry):
    q, k, v = _inputs()
    result = ENTRIES[entry].fn(*ENTRIES[entry].pack(q, k, v), return_attn_probs=True)
    assert isinstance(result, tuple) and len(result) == 3
    out, lse, s_dmask = result
    batch, seqlen_q, num_heads, _ = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (batch, num_heads, seqlen_q) and lse.dtype == torch.float32
    assert s_dmask.shape == (0,) and s_dmask.dtype == q.dtype
    assert torch.equal(out, ENTRIES[entry].fn(*ENTRIES[entry].pack(q, k, v)))
    _assert_close_to_reference(SELF_CASE, out, lse, q, k, v)


def test_kvpacked_gqa_return_shapes():
    q, k, v = _inputs(GQA_CASE)
    out, lse, s_dmask = flash_attn.flash_attn_kvpacked_func(q, torch.stack((k, v), dim=2), causal=True,
                                                            return_attn_probs=True)
    assert out.shape == (2, 24, 4, 32)
    assert lse.shape == (2, 4, 24)
    assert s_dmask.shape == (0,)
    _assert_close_to_reference(GQA_CASE, out, lse, q, k, v)


def test_out_is_contiguous():
    # docs/api.md §2.3: we SHOULD return a contiguous out of the documented shape (callers call .view() on it).
    q, k, v = _inputs(GQA_CASE)
    out = flash_attn.flash_attn_func(q, k, v, causal=True)
    assert out.is_contiguous(), f"out strides {out.stride()}"


@pytest.mark.parametrize("entry", ENTRIES)
def test_gradients_have_the_shapes_of_the_inputs(entry):
    q, k, v = _inputs()
    leaves = ENTRIES[entry].leaves(q, k, v)
    out = ENTRIES[entry].fn(*leaves)
    out.backward(torch.randn_like(out))
    for leaf in leaves:
        assert leaf.grad is not None
        assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == leaf.dtype
        assert torch.isfinite(leaf.grad).all()


@pytest.mark.parametrize("entry", ["qkvpacked", "kvpacked"])
def test_packed_entry_points_match_flash_attn_func(entry):
    q, k, v = _inputs()
    dout = torch.randn_like(q)
    reference_leaves = ENTRIES["func"].leaves(q, k, v)
    reference_out = flash_attn.flash_attn_func(*reference_leaves)
    reference_out.backward(dout)
    leaves = ENTRIES[entry].leaves(q, k, v)
    out = ENTRIES[entry].fn(*leaves)
    out.backward(dout)
    assert torch.equal(out, reference_out)
    packed_grads = torch.cat([leaf.grad.flatten() for leaf in leaves])
    reference_grads = torch.cat([t.flatten() for t in ENTRIES[entry].pack(*(t.grad for t in reference_leaves))])
    assert torch.equal(packed_grads, reference_grads)


def test_func_gqa_gradients_match_reference():
    q, k, v = _inputs(GQA_CASE)
    leaves = ENTRIES["func"].leaves(q, k, v)
    out, lse, _ = flash_attn.flash_attn_func(*leaves, causal=True, return_attn_probs=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert [leaf.grad.shape for leaf in leaves] == [q.shape, k.shape, v.shape]
    _assert_close_to_reference(GQA_CASE, out, lse, q, k, v, grads=[leaf.grad for leaf in leaves], dout=dout)


@pytest.mark.parametrize("entry", ENTRIES)
def test_gradients_into_lse_and_s_dmask_are_ignored(entry):
    q, k, v = _inputs()
    weight = torch.randn(q.shape)
    grads = []
    for through_lse in (False, True):
        leaves = ENTRIES[entry].leaves(q, k, v)
        out, lse, s_dmask = ENTRIES[entry].fn(*leaves, causal=True, return_attn_probs=True)
        loss = (out.float() * weight).sum()
        if through_lse:
            loss = loss + lse.sum() + s_dmask.float().sum()
        loss.backward()
        grads.append([leaf.grad for leaf in leaves])
    for without, with_lse in zip(*grads):
        assert torch.equal(without, with_lse)


@pytest.fixture
def saved_for_backward(monkeypatch):
    """Counts calls of ctx.save_for_backward made by any autograd.Function."""
    calls = []
    original = torch.autograd.function.FunctionCtx.save_for_backward

    def recording(self, *tensors):
        calls.append(len(tensors))
        return original(self, *tensors)

    monkeypatch.setattr(torch.autograd.function.FunctionCtx, "save_for_backward", recording)
    return calls


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("requires_grad,grad_enabled,saves", [
    pytest.param(False, True, False, id="inputs-without-grad"),
    pytest.param(True, False, False, id="no_grad-mode"),
    pytest.param(True, True, True, id="training"),
])
def test_tensors_are_saved_only_when_needed(entry, requires_grad, grad_enabled, saves, saved_for_backward):
    q, k, v = _inputs()
    leaves = ENTRIES[entry].leaves(q, k, v, requires_grad=requires_grad)
    with torch.set_grad_enabled(grad_enabled):
        out = ENTRIES[entry].fn(*leaves)
    assert bool(saved_for_backward) == saves
    assert out.requires_grad == saves


@pytest.mark.parametrize("entry", ENTRIES)
def test_inference_calls_give_the_training_calls_results(entry):
    """Calls where nothing needs a gradient skip autograd.Function (host time) and return the same tensors."""
    q, k, v = _inputs()
    training = ENTRIES[entry].fn(*ENTRIES[entry].leaves(q, k, v), return_attn_probs=True)
    inference = ENTRIES[entry].fn(*ENTRIES[entry].leaves(q, k, v, requires_grad=False), return_attn_probs=True)
    assert training[0].grad_fn is not None and inference[0].grad_fn is None
    for a, b in zip(training, inference):
        assert torch.equal(a.detach(), b)


@pytest.mark.parametrize("window", [
    pytest.param(torch.tensor([3, 1]), id="tensor-of-2"),
    pytest.param((torch.tensor(3), torch.tensor([1])), id="0d-and-1-element-tensors"),
    pytest.param((np.int64(3), np.int32(1)), id="numpy-ints"),
    pytest.param([3, 1], id="list"),
])
def test_window_size_accepts_int_likes(window):
    case = Case(batch=2, seqlen_q=40, seqlen_k=40, num_heads=2, num_heads_k=2, head_dim=32, window_size=(3, 1))
    q, k, v = _inputs(case)
    leaves = ENTRIES["func"].leaves(q, k, v)
    out, lse, _ = flash_attn.flash_attn_func(*leaves, window_size=window, return_attn_probs=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    expected_leaves = ENTRIES["func"].leaves(q, k, v)
    expected = flash_attn.flash_attn_func(*expected_leaves, window_size=(3, 1))
    expected.backward(dout)
    assert torch.equal(out, expected)
    for leaf, expected_leaf in zip(leaves, expected_leaves):
        assert torch.equal(leaf.grad, expected_leaf.grad)
    _assert_close_to_reference(case, out, lse, q, k, v)


# The reference and every launcher take the window from flashtriton.scores, so its rewrite is checked here against
# the steps of docs/api.md §4.2.3 directly. S* = 10: (window_size, causal) -> (window the mask uses, pure causal).
WINDOW_REWRITES = [
    ((-1, -1), False, (-1, -1), False),
    ((-1, -1), True, (10, 0), True),
    ((-1, 0), False, (10, 0), True),
    ((12, 12), True, (10, 0), True),
    ((12, 12), False, (-1, -1), False),
    ((10, 2), False, (10, 2), False),
    ((3, -1), False, (3, 10), False),
    ((3, 12), False, (3, 10), False),
    ((3, 2), True, (3, 0), False),
    ((0, 0), False, (0, 0), False),
]


@pytest.mark.parametrize("window, causal, normalized, pure_causal", WINDOW_REWRITES,
                         ids=[f"{w[0]}_{w[1]}{'_causal' if c else ''}" for w, c, _, _ in WINDOW_REWRITES])
def test_window_rewrite_follows_fa2(window, causal, normalized, pure_causal):
    from flashtriton.scores import normalize_window, score_params

    assert normalize_window(window, causal, 10) == normalized
    params = score_params(0.5, causal, *window, 0.0, 10)
    assert (params.window_left, params.window_right, params.alibi_pure_causal) == (*normalized, pure_causal)
    assert params.is_local == (normalized[0] >= 0)
    assert params.causal_like == (normalized[1] == 0)


def test_kernel_scores_fold_the_softcap_into_log2_units():
    from flashtriton.scores import LOG2E, score_params

    assert score_params(0.5, False, -1, -1, 0.0, 10).kernel_scores() == (0.5 * LOG2E, 0.0, 0.0)
    assert score_params(0.5, False, -1, -1, 20.0, 10).kernel_scores() == (0.5 * LOG2E, 0.5 / 20.0, 20.0 * LOG2E)


def _strided_last_dim(tensor):
    """A leaf twice as wide in the last dim, and the view of it holding `tensor` at stride 2."""
    wide = torch.zeros(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype)
    wide[..., ::2] = tensor
    wide.requires_grad_()
    return wide, wide[..., ::2]


@pytest.mark.parametrize("entry", ENTRIES)
def test_non_contiguous_last_dim_inputs_are_accepted(entry):
    q, k, v = _inputs()
    dout = torch.randn_like(q)
    expected_leaves = ENTRIES[entry].leaves(q, k, v)
    expected = ENTRIES[entry].fn(*expected_leaves)
    expected.backward(dout)
    wides, views = zip(*(_strided_last_dim(t) for t in ENTRIES[entry].pack(q, k, v)))
    assert all(view.stride(-1) == 2 for view in views)
    out = ENTRIES[entry].fn(*views)
    out.backward(dout)
    assert torch.equal(out, expected)
    for wide, expected_leaf in zip(wides, expected_leaves):
        assert torch.equal(wide.grad[..., ::2], expected_leaf.grad)
        assert not wide.grad[..., 1::2].any()


@pytest.mark.parametrize("entry,index", [("func", 0), ("func", 1), ("func", 2), ("qkvpacked", 0),
                                         ("kvpacked", 0), ("kvpacked", 1)])
def test_single_strided_input_requiring_grad_gets_its_gradient(entry, index):
    q, k, v = _inputs()
    dout = torch.randn_like(q)
    expected_leaves = ENTRIES[entry].leaves(q, k, v)
    ENTRIES[entry].fn(*expected_leaves).backward(dout)
    tensors = list(ENTRIES[entry].pack(q, k, v))
    wide, tensors[index] = _strided_last_dim(tensors[index])
    ENTRIES[entry].fn(*tensors).backward(dout)
    assert torch.equal(wide.grad[..., ::2], expected_leaves[index].grad)


def test_non_contiguous_last_dim_dout_is_accepted():
    q, k, v = _inputs()
    dout = torch.randn_like(q)
    expected_leaves = ENTRIES["func"].leaves(q, k, v)
    flash_attn.flash_attn_func(*expected_leaves).backward(dout)
    leaves = ENTRIES["func"].leaves(q, k, v)
    _, strided_dout = _strided_last_dim(dout)
    flash_attn.flash_attn_func(*leaves).backward(strided_dout.detach())
    for leaf, expected_leaf in zip(leaves, expected_leaves):
        assert torch.equal(leaf.grad, expected_leaf.grad)


# ------------------------------------------------------------------------------------------------------------
# Low-level API (docs/api.md §7)
# ------------------------------------------------------------------------------------------------------------


def _low_level_forward(q, k, v, softmax_scale, causal=False):
    return fai._flash_attn_forward(q, k, v, 0.0, softmax_scale, causal, -1, -1, 0.0, None, False)


def test_low_level_forward_returns_out_lse_s_dmask_rng_state():
    q, k, v = _inputs(GQA_CASE)
    scale = 0.3
    result = _low_level_forward(q, k, v, scale, causal=True)
    assert isinstance(result, tuple) and len(result) == 4
    out, lse, s_dmask, rng_state = result
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, 4, 24) and lse.dtype == torch.float32
    assert s_dmask.shape == (0,) and s_dmask.dtype == q.dtype
    assert rng_state.shape == (2,) and rng_state.dtype == torch.int64 and rng_state.device == q.device
    public_out, public_lse, _ = flash_attn.flash_attn_func(q, k, v, softmax_scale=scale, causal=True,
                                                           return_attn_probs=True)
    assert torch.equal(out, public_out)
    assert torch.equal(lse, public_lse)


def test_low_level_forward_accepts_keyword_arguments():
    q, k, v = _inputs()
    out, lse, _, _ = fai._flash_attn_forward(q=q, k=k, v=v, dropout_p=0.0, softmax_scale=0.25, causal=False,
                                             window_size_left=-1, window_size_right=-1, softcap=0.0,
                                             alibi_slopes=None, return_softmax=False)
    positional_out, positional_lse, _, _ = _low_level_forward(q, k, v, 0.25)
    assert torch.equal(out, positional_out)
    assert torch.equal(lse, positional_lse)


def test_low_level_forward_return_softmax_needs_dropout():
    q, k, v = _inputs()
    message = "return_softmax is only supported when p_dropout > 0.0"
    with pytest.raises(RuntimeError, match=re.escape(message)):
        fai._flash_attn_forward(q, k, v, 0.0, 0.25, False, -1, -1, 0.0, None, True)


# Each returns ((dq, dk, dv), the NaN-filled tensors whose every element the backward must overwrite).
def _separate_buffers(q, k, v):
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    return grads, grads


def _qkv_packed_buffers(q, k, v):
    dqkv = torch.full((*q.shape[:2], 3, *q.shape[2:]), float("nan"), dtype=q.dtype)
    return (dqkv[:, :, 0], dqkv[:, :, 1], dqkv[:, :, 2]), [dqkv]


def _kv_packed_buffers(q, k, v):
    dq = torch.full_like(q, float("nan"))
    dkv = torch.full((*k.shape[:2], 2, *k.shape[2:]), float("nan"), dtype=k.dtype)
    return (dq, dkv[:, :, 0], dkv[:, :, 1]), [dq, dkv]


@pytest.mark.parametrize("case,make_buffers", [
    pytest.param(GQA_CASE, _separate_buffers, id="separate-gqa"),
    pytest.param(SELF_CASE, _qkv_packed_buffers, id="qkv-packed-views"),
    pytest.param(GQA_CASE, _kv_packed_buffers, id="kv-packed-views"),
])
def test_low_level_backward_writes_into_preallocated_buffers(case, make_buffers):
    q, k, v = _inputs(case)
    scale = 0.3
    out, lse, _, rng_state = _low_level_forward(q, k, v, scale, causal=case.causal)
    dout = torch.randn_like(out)
    (dq, dk, dv), storage = make_buffers(q, k, v)
    with poisoned_outputs():  # softmax_d's padding rows are written by the kernels: NaN if one is missed
        softmax_d = fai._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, case.causal, -1, -1,
                                             0.0, None, False, rng_state)
    batch, seqlen_q, num_heads, _ = q.shape
    assert softmax_d.shape == (batch, num_heads, fai.round_multiple(seqlen_q, 128))
    assert softmax_d.dtype == torch.float32
    rowsum = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(softmax_d[:, :, :seqlen_q], rowsum)
    assert torch.equal(softmax_d[:, :, seqlen_q:], torch.zeros_like(softmax_d[:, :, seqlen_q:]))

    leaves = ENTRIES["func"].leaves(q, k, v)
    public_out = flash_attn.flash_attn_func(*leaves, softmax_scale=scale, causal=case.causal)
    public_out.backward(dout)
    for written, leaf in zip((dq, dk, dv), leaves):
        assert torch.equal(written, leaf.grad)
    assert not any(buffer.isnan().any() for buffer in storage)
    scaled_case = dataclasses.replace(case, softmax_scale=scale)
    _assert_close_to_reference(scaled_case, out, lse, q, k, v, grads=(dq, dk, dv), dout=dout)


def test_wrapped_aliases_are_the_low_level_ops():
    assert fai._wrapped_flash_attn_forward is fai._flash_attn_forward
    assert fai._wrapped_flash_attn_backward is fai._flash_attn_backward


# ------------------------------------------------------------------------------------------------------------
# torch.compile (docs/api.md §2.9)
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ENTRIES)
def test_torch_compile_fullgraph_matches_eager(entry):
    torch.compiler.reset()
    q, k, v = _inputs()
    dout = torch.randn_like(q)

    def attention(*tensors):
        out, lse, _ = ENTRIES[entry].fn(*tensors, causal=True, return_attn_probs=True)
        return out, lse

    assert_compiled_matches_eager(attention, lambda: ENTRIES[entry].leaves(q, k, v), dout)


def test_opcheck_forward():
    q, k, v = _inputs(GQA_CASE)
    args = (q, k, v, 0.0, 0.3, True, -1, -1, 0.0, None, False)
    torch.library.opcheck(torch.ops.flashtriton._flash_attn_forward.default, args)


def test_opcheck_backward():
    q, k, v = _inputs(GQA_CASE)
    out, lse, _, rng_state = _low_level_forward(q, k, v, 0.3, causal=True)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    args = (torch.randn_like(out), q, k, v, out, lse, *grads, 0.0, 0.3, True, -1, -1, 0.0, None, False, rng_state)
    torch.library.opcheck(torch.ops.flashtriton._flash_attn_backward.default, args)


def _varlen_inputs(lengths=(5, 0, 17), num_heads=4, num_heads_k=2, head_dim=32, tail=2):
    cu = cu_seqlens(lengths)
    total = sum(lengths) + tail
    q = torch.randn(total, num_heads, head_dim).half()
    k, v = (torch.randn(total, num_heads_k, head_dim).half() for _ in range(2))
    return q, k, v, cu, max(lengths)


VARLEN_ENTRIES = {
    "varlen": (flash_attn.flash_attn_varlen_func, lambda q, k, v: (q, k, v)),
    "varlen-kvpacked": (flash_attn.flash_attn_varlen_kvpacked_func, lambda q, k, v: (q, torch.stack((k, v), dim=1))),
}


@pytest.mark.parametrize("entry", VARLEN_ENTRIES)
def test_torch_compile_fullgraph_varlen_matches_eager(entry):
    """Varlen through torch.compile(fullgraph=True): cu_seqlens are graph inputs, the ops' fake impls trace."""
    torch.compiler.reset()
    fn, pack = VARLEN_ENTRIES[entry]
    q, k, v, cu, max_seqlen = _varlen_inputs()
    dout = torch.randn_like(q)

    def attention(*tensors):
        out, lse, _ = fn(*tensors, cu, cu, max_seqlen, max_seqlen, causal=True, return_attn_probs=True)
        return out, lse

    assert_compiled_matches_eager(attention, lambda: [t.detach().clone().requires_grad_() for t in pack(q, k, v)],
                                   dout)


def test_opcheck_varlen_forward():
    q, k, v, cu, max_seqlen = _varlen_inputs()
    args = (q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, 0.3, True)
    torch.library.opcheck(torch.ops.flashtriton._flash_attn_varlen_forward.default, args)


def test_opcheck_varlen_backward():
    q, k, v, cu, max_seqlen = _varlen_inputs()
    out, lse, _, rng_state = fai._flash_attn_varlen_forward(q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, 0.3, True)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    args = (torch.randn_like(out), q, k, v, out, lse, *grads, cu, cu, max_seqlen, max_seqlen, 0.0, 0.3, True, -1, -1,
            0.0, None, False, rng_state)
    torch.library.opcheck(torch.ops.flashtriton._flash_attn_varlen_backward.default, args)


def test_public_functions_under_fake_tensors_use_the_ops_fake_implementations():
    """Eager calls skip torch.library's dispatch; fake tensors (shape propagation, compile tracing) must still
    reach the fake implementations, which run the same checks and launch nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 5, 4, 64, dtype=torch.float16)
        k = torch.empty(2, 9, 2, 64, dtype=torch.float16)
        out, lse, _ = flash_attn.flash_attn_func(q, k, k, causal=True, return_attn_probs=True)
        assert out.shape == q.shape and lse.shape == (2, 4, 5)
        cache = torch.empty(2, 32, 2, 64, dtype=torch.float16)
        out, lse = flash_attn.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=3, return_softmax_lse=True)
        assert out.shape == q.shape and lse.shape == (2, 4, 5)
        with pytest.raises(RuntimeError, match="Number of heads in key/value must divide"):
            flash_attn.flash_attn_func(q, torch.empty(2, 9, 3, 64, dtype=torch.float16), k)
