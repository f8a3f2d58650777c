"""flashtriton.integrations.transformers: tiny random-init transformers models (built from configs, nothing
downloaded) run with attn_implementation=<registered name> against the same weights under "eager".

Models run in float16 (in bfloat16, rounding alone flips some greedy tokens of these tiny random models, eager's
included). Logits and parameter gradients are held to a float64 copy of the model under "eager": the error of the
flashtriton model may be at most twice the error of the same-dtype "eager" model plus a floor of four roundings
(4 eps) of the reference's largest magnitude. The float64 oracle runs
each row's valid tokens alone, unpadded (float64 "eager" turns the fully masked query rows of a left-padded row into
NaN, which its values then carry into every row position of the next layer); padded positions, where eager computes
values no valid token reads, are left out. Greedy generate() is token-for-token eager's, but for ties of the
float64 model at float16's resolution.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma2Config,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from flashtriton.integrations import transformers as ft_transformers  # noqa: E402
from flashtriton.testing import assert_checks_ok, check_error  # noqa: E402

NAME = ft_transformers.register()
DTYPE = torch.float16
SEQ = 16
WINDOW = 5  # binds at SEQ: Mistral's layers and Gemma2's sliding layers see 5 keys

_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=64, initializer_range=0.3,
               pad_token_id=0, bos_token_id=1, eos_token_id=127)

CONFIGS = {
    "llama": lambda **kw: LlamaConfig(**_COMMON, **kw),
    "qwen2": lambda **kw: Qwen2Config(**_COMMON, **kw),
    "mistral": lambda **kw: MistralConfig(**_COMMON, sliding_window=WINDOW, **kw),
    # layers alternate sliding / full; a logit softcap of 2 binds for these weights
    "gemma2": lambda **kw: Gemma2Config(**_COMMON, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                                        query_pre_attn_scalar=8, **kw),
    # attention sinks (s_aux), layers alternate sliding / full, a mixture of experts
    "gpt_oss": lambda **kw: GptOssConfig(**_COMMON, sliding_window=WINDOW, num_local_experts=2, num_experts_per_tok=1,
                                         layer_types=["sliding_attention", "full_attention"],
                                         rope_parameters=dict(rope_type="default", rope_theta=10000.0), **kw),
}
# from_config options beyond attention: gpt-oss's experts in plain PyTorch (its grouped matmul has no float64)
BUILD_OPTIONS = {"gpt_oss": dict(experts_implementation="eager")}


def _models(kind: str, dtype: torch.dtype = DTYPE, **config_kwargs):
    """(flashtriton model, eager model) in DTYPE and the float64 eager oracle, all with the same weights."""
    def build(attn_implementation: str, dtype: torch.dtype):
        # from_config keeps the config object it is given (and sets its attention implementation): one config
        # each. Built in its dtype, a model keeps its rotary inv_freq in float32, as from_pretrained does.
        return AutoModelForCausalLM.from_config(CONFIGS[kind](**config_kwargs),
                                                attn_implementation=attn_implementation, dtype=dtype,
                                                **BUILD_OPTIONS.get(kind, {})).eval()

    torch.manual_seed(0)
    ref = build("eager", torch.float64)
    weights = ref.state_dict()
    eager, ours = build("eager", dtype), build(NAME, dtype)
    eager.load_state_dict(weights)
    ours.load_state_dict(weights)
    assert ours.config._attn_implementation == NAME
    assert eager.config._attn_implementation == ref.config._attn_implementation == "eager"
    return ours, eager, ref


def _padded_batch():
    """Rows: full, left-padded by 5, right-padded by 3; positions count valid tokens, as in generate()."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(2, 127, (3, SEQ), generator=generator)
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, -3:] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, mask, position_ids


def _floor(ref: torch.Tensor, dtype: torch.dtype = DTYPE) -> float:
    return 4 * torch.finfo(dtype).eps * float(ref.abs().max())


def _rows_alone(model, inputs: dict, valid: torch.Tensor) -> torch.Tensor:
    """Logits of each row's valid tokens, each row run alone without padding: (valid.sum(), vocab)."""
    rows = []
    for b in range(valid.shape[0]):
        keep = valid[b]
        rows.append(model(input_ids=inputs["input_ids"][b:b + 1, keep],
                          position_ids=inputs["position_ids"][b:b + 1, keep]).logits[0])
    return torch.cat(rows)


def _logits_and_grads(model, inputs: dict, valid: torch.Tensor, weights: torch.Tensor, alone: bool = False):
    model.zero_grad(set_to_none=True)
    logits = _rows_alone(model, inputs, valid) if alone else model(**inputs).logits[valid]
    loss = (logits.double() * weights).sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _compare(ours, eager, ref, inputs: dict, valid: torch.Tensor, context: str):
    weights = torch.randn(int(valid.sum()), 128, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out, grads = _logits_and_grads(ours, inputs, valid, weights)
    out_eager, grads_eager = _logits_and_grads(eager, inputs, valid, weights)
    out_ref, grads_ref = _logits_and_grads(ref, inputs, valid, weights, alone="attention_mask" in inputs)
    checks = [check_error("logits", out, out_ref, out_eager, atol=_floor(out_ref))]
    assert set(grads) == set(grads_ref)
    for name, g_ref in grads_ref.items():
        checks.append(check_error(f"grad {name}", grads[name], g_ref, grads_eager[name], atol=_floor(g_ref)))
    assert_checks_ok(checks, context)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_padded_logits_and_gradients_match_eager(kind):
    ours, eager, ref = _models(kind)
    input_ids, mask, position_ids = _padded_batch()
    inputs = dict(input_ids=input_ids, attention_mask=mask, position_ids=position_ids)
    _compare(ours, eager, ref, inputs, mask.bool(), kind)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_greedy_generate_matches_eager(kind):
    """Token for token eager's, except where the float64 model itself has a tie at float16's resolution: there the
    two candidates' float64 logits differ by less than eager's own float16 error, and rounding picks either (a row
    is compared up to such a step, after which the continuations differ by construction)."""
    ours, eager, ref = _models(kind)
    input_ids, mask, _ = _padded_batch()
    input_ids, mask = input_ids[:2, :10], mask[:2, 6:]  # row 1 left-padded by 5 of 10
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    with torch.no_grad():
        tokens = ours.generate(input_ids, **kwargs)
        tokens_eager = eager.generate(input_ids, **kwargs)
    assert tokens.shape == (2, 15)
    for row in range(2):
        differ = (tokens[row] != tokens_eager[row]).nonzero().flatten().tolist()
        if not differ:
            continue
        step = differ[0]
        with torch.no_grad():
            prefix = dict(input_ids=tokens[row:row + 1, :step], attention_mask=torch.cat(
                [mask[row:row + 1], torch.ones(1, step - 10, dtype=mask.dtype)], dim=1))
            logits_ref = ref(**prefix).logits[0, -1]
            eager_error = float((eager(**prefix).logits[0, -1].double() - logits_ref).abs().max())
        gap = float((logits_ref[tokens[row, step]] - logits_ref[tokens_eager[row, step]]).abs())
        assert gap < eager_error, (f"{kind} row {row}: {tokens[row, 10:].tolist()} vs "
                                   f"{tokens_eager[row, 10:].tolist()}, float64 gap {gap:.3g} >= eager's error "
                                   f"{eager_error:.3g}")


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_several_new_tokens_on_a_padded_cache_match_eager(kind):
    """12 tokens into the cache, then 4 in one call: queries are the last 4 of each row's keys (left padding)."""
    ours, eager, ref = _models(kind)
    input_ids, mask, position_ids = (t[:2] for t in _padded_batch())
    outs = []
    with torch.no_grad():
        for model in (ours, eager):
            cached = model(input_ids=input_ids[:, :12], attention_mask=mask[:, :12],
                           position_ids=position_ids[:, :12], use_cache=True).past_key_values
            outs.append(model(input_ids=input_ids[:, 12:], attention_mask=mask, position_ids=position_ids[:, 12:],
                              cache=cached).logits)
        rows = [ref(input_ids=input_ids[b:b + 1, mask[b].bool()]).logits[0, -4:] for b in range(2)]
    out_ref = torch.stack(rows)
    assert_checks_ok([check_error("logits", outs[0], out_ref, outs[1], atol=_floor(out_ref))], kind)


def test_unpadded_generate_past_the_window_matches_eager():
    """No padding: every call is dense (prefill, then decode over the sliding layers' truncated cache)."""
    ours, eager, _ = _models("gemma2")
    input_ids = _padded_batch()[0][:2, :8]
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)
    with torch.no_grad():
        tokens = ours.generate(input_ids, **kwargs)
        tokens_eager = eager.generate(input_ids, **kwargs)
    assert torch.equal(tokens, tokens_eager), f"{tokens[:, 8:].tolist()} vs {tokens_eager[:, 8:].tolist()}"


def test_from_pretrained_takes_the_name(tmp_path):
    ours, eager, _ = _models("qwen2")
    eager.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=NAME, dtype=DTYPE)
    assert loaded.config._attn_implementation == NAME
    input_ids, mask, _ = _padded_batch()
    with torch.no_grad():
        out = loaded(input_ids=input_ids, attention_mask=mask).logits
        out_ours = ours(input_ids=input_ids, attention_mask=mask).logits
    assert torch.equal(out[mask.bool()], out_ours[mask.bool()])


@pytest.mark.parametrize("boundaries", ["position_ids", "cu_seq_lens"])
def test_packed_sequences_match_eager(boundaries):
    """Three sequences (6, 7, 3 tokens) packed in one row, no mask: eager separates them from the restarting
    position_ids; flashtriton from the same position_ids, or from cu_seq_lens_q/k given as kwargs."""
    ours, eager, ref = _models("mistral")
    lengths = [6, 7, 3]
    input_ids = torch.randint(2, 127, (1, SEQ), generator=torch.Generator().manual_seed(3))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    # eager looks for packed sequences only without a cache; flashtriton, as transformers' flash path, always
    inputs = dict(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    valid = torch.ones(1, SEQ, dtype=torch.bool)
    if boundaries == "position_ids":
        _compare(ours, eager, ref, inputs, valid, "packed")
        return
    cu = torch.tensor([0, 6, 13, 16], dtype=torch.int32)
    with torch.no_grad():
        # eager never reads these kwargs; ours uses them in place of the position_ids rule
        out = ours(**inputs, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7).logits
        out_eager = eager(**inputs).logits
        out_ref = ref(**inputs).logits
        out_unpacked = ours(input_ids=input_ids).logits
    assert_checks_ok([check_error("logits", out, out_ref, out_eager, atol=_floor(out_ref))], "cu_seq_lens")
    assert not torch.allclose(out_unpacked[:, 6:], out[:, 6:], atol=_floor(out_ref)), "packing had no effect"


def test_float32_model_attends_in_bfloat16():
    """A float32 model: q/k/v go to bfloat16 and the attention output comes back as float32; held to the
    bfloat16 eager model's error."""
    _, eager, ref = _models("llama", dtype=torch.bfloat16)
    ours = AutoModelForCausalLM.from_config(CONFIGS["llama"](), attn_implementation=NAME, dtype=torch.float32)
    ours.load_state_dict(ref.state_dict())
    ours.eval()
    input_ids, mask, position_ids = _padded_batch()
    inputs = dict(input_ids=input_ids, attention_mask=mask, position_ids=position_ids)
    valid = mask.bool()
    with torch.no_grad():
        out = ours(**inputs).logits
        out_eager = eager(**inputs).logits[valid]
        out_ref = _rows_alone(ref, inputs, valid)
    assert out.dtype == torch.float32
    assert_checks_ok([check_error("logits", out[valid], out_ref, out_eager, atol=_floor(out_ref, torch.bfloat16))],
                     "float32")


def test_dropout_in_training_only():
    ours, _, _ = _models("llama", attention_dropout=0.5)
    input_ids, mask, _ = _padded_batch()
    valid = mask.bool()
    with torch.no_grad():
        out_eval = ours(input_ids=input_ids, attention_mask=mask).logits[valid]
        out_eval_again = ours(input_ids=input_ids, attention_mask=mask).logits[valid]
    ours.train()
    logits = ours(input_ids=input_ids, attention_mask=mask).logits
    logits[valid].float().sum().backward()
    assert torch.equal(out_eval, out_eval_again)
    assert torch.isfinite(logits[valid]).all()
    assert not torch.allclose(logits.detach()[valid], out_eval, atol=_floor(out_eval.double()))
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)


def test_register_refuses_names_transformers_reroutes():
    with pytest.raises(ValueError, match="contains 'flash'.*flash_attn"):
        ft_transformers.register("flashtriton")
    with pytest.raises(ValueError, match="contains 'sdpa'"):
        ft_transformers.register("my_sdpa")
    assert ft_transformers.register("triton_fa_alias") == "triton_fa_alias"


def test_unsupported_features_raise_naming_the_alternative():
    ours, _, _ = _models("llama")
    input_ids, mask, _ = _padded_batch()
    with torch.no_grad():
        with pytest.raises(ValueError, match="output_attentions=True.*attn_implementation='eager'"):
            ours(input_ids=input_ids, attention_mask=mask, output_attentions=True)
        mask_4d = torch.zeros(3, 1, SEQ, SEQ, dtype=DTYPE)
        with pytest.raises(ValueError, match=r"2-D \(batch, kv_len\) padding mask.*got \(3, 1, 16, 16\).*'sdpa'"):
            ours(input_ids=input_ids, attention_mask=mask_4d)
        with pytest.raises(NotImplementedError, match="static.*dynamic cache"):
            ours.generate(input_ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                          cache_implementation="static")
        with pytest.raises(TypeError, match="float16/bfloat16.*torch.float64.*'eager'"):
            ours.double()(input_ids=input_ids, attention_mask=mask)


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("head_dim_v", [8, 24])
def test_value_head_dim_of_its_own_goes_through_unpadded(head_dim_v, padded):
    """MLA-style attention (V's head dim narrower or wider than Q / K's) through the attention function, against
    math SDPA in float64 (fp16 SDPA sets the tolerance), on the rows a valid query owns."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, SEQ, 16, generator=generator).to(DTYPE)
    k = torch.randn(2, 2, SEQ, 16, generator=generator).to(DTYPE)
    v = torch.randn(2, 2, SEQ, head_dim_v, generator=generator).to(DTYPE)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    if padded:
        mask[1, :5] = 0
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = ft_transformers.attention_forward(module, q, k, v, mask if padded else None, scaling=0.25)
    assert out.shape == (2, SEQ, 4, head_dim_v) and out.dtype == DTYPE

    def sdpa(dtype):
        visible = torch.ones(SEQ, SEQ, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]
        return torch.nn.functional.scaled_dot_product_attention(
            q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=visible, scale=0.25, enable_gqa=True).transpose(1, 2)

    valid = mask.bool()
    assert_checks_ok([check_error("out", out[valid], sdpa(torch.float64)[valid], sdpa(DTYPE)[valid])],
                     f"head_dim_v {head_dim_v}")
