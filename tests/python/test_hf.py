"""kvq.hf (KVQCache + attn_implementation="kvq") against transformers' own DynamicCache with its eager
and sdpa attention, on small random-weight Llama and Qwen2 models (GQA, odd lengths) and on the real
Qwen2.5-Coder-0.5B-Instruct loaded by transformers from its GGUF file; and the exceptions of bad input.

Skips (with the reason) without torch, transformers (scripts/install-deps.sh installs both) or a
transformers version outside kvq.hf.SUPPORTED_TRANSFORMERS; the real-model test also without the
gguf package or models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf (scripts/fetch-models.sh).
"""
import pytest

from conftest import SOURCE_DIR

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-deps.sh)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (scripts/install-deps.sh)")
kvq = pytest.importorskip("kvq", reason="the kvq module is not importable (pip install . or PYTHONPATH=build/python)")
try:
    import kvq.hf as kvq_hf
except ImportError as e:  # a transformers version outside the supported range
    pytest.skip(str(e), allow_module_level=True)

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

THREADS = 2


def llama():
    # GQA 4 (8 query heads, 2 kv heads), head_dim 32
    cfg = LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.08)
    torch.manual_seed(1)
    return LlamaForCausalLM(cfg).eval()


def qwen2():
    # GQA 2 (4 query heads, 2 kv heads), head_dim 64, q/k/v biases (Qwen2's)
    cfg = Qwen2Config(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.08, use_sliding_window=False)
    torch.manual_seed(2)
    return Qwen2ForCausalLM(cfg).eval()


MODELS = {"llama": llama, "qwen2": qwen2}
_models = {}


def model(name, attn):
    if name not in _models:
        _models[name] = MODELS[name]()
    m = _models[name]
    m.set_attn_implementation(attn)
    return m


def prompt_ids(n, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 320, (batch, n), generator=g)


@torch.no_grad()
def greedy(m, ids, cache, n_new):
    out = m.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n_new,
                     min_new_tokens=n_new, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


@torch.no_grad()
def forced_logits(m, ids, cache, chunks):
    """Logits [n_tokens, vocab] of batch row 0, the sequence fed in chunks of the given sizes (a split
    prompt, then one token at a time): prefill at position 0, prefill after a cached prefix, decode."""
    out, pos = [], 0
    for n in chunks:
        out.append(m(ids[:, pos:pos + n], past_key_values=cache, use_cache=True).logits[0])
        pos += n
    return torch.cat(out).double()


def rel(a, b):
    return float((a - b).norm() / b.norm())


def kvq_cache(m, n_ctx=128, **opts):
    return kvq_hf.KVQCache(m.config, max_cache_len=n_ctx, n_threads=THREADS, **opts)


N_PROMPT, N_NEW = 37, 15  # an odd prompt fed as 20 + 17 tokens, then 14 decode steps
CHUNKS = [20, 17] + [1] * (N_NEW - 1)
_refs = {}


def reference(name):
    """DynamicCache + eager attention: greedy tokens [1, N_NEW] and teacher-forced logits; the greedy
    tokens of DynamicCache + sdpa are checked equal to eager's once."""
    if name not in _refs:
        ids = prompt_ids(N_PROMPT, seed=3)
        m = model(name, "eager")
        tokens = greedy(m, ids, DynamicCache(config=m.config), N_NEW)
        seq = torch.cat([ids, tokens], dim=1)[:, :-1]
        logits = forced_logits(m, seq, DynamicCache(config=m.config), CHUNKS)
        m = model(name, "sdpa")
        assert torch.equal(greedy(m, ids, DynamicCache(config=m.config), N_NEW), tokens)
        _refs[name] = ids, tokens, seq, logits
    return _refs[name]


# (type_k, type_v, options, bound on the norm-wise relative logits error against DynamicCache + eager,
# and whether greedy tokens must equal its): about 2-3x the worst measured on these two models (f32
# 1.1e-6, f16 7.9e-4: rounding; q8 0.022 and kivi4/q4a sink 4 0.15: random weights give near-uniform
# attention over unstructured K, which makes quantization noise large; their token agreement is
# reported, not required).
CONFIGS = [
    ("f32", "f32", {}, 3e-6, True),
    ("f16", "f16", {}, 2e-3, True),
    ("q8", "q8", {}, 0.05, False),
    ("kivi4", "q4a", {"sink": 4}, 0.3, False),
]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("type_k,type_v,opts,tol,exact", CONFIGS)
def test_kvq_cache_matches_dynamic_cache(name, type_k, type_v, opts, tol, exact):
    ids, ref_tokens, seq, ref = reference(name)
    m = model(name, "kvq")
    tokens = greedy(m, ids, kvq_cache(m, type_k=type_k, type_v=type_v, **opts), N_NEW)
    got = forced_logits(m, seq, kvq_cache(m, type_k=type_k, type_v=type_v, **opts), CHUNKS)
    err = rel(got, ref)
    same = int((tokens == ref_tokens).cumprod(1).sum())
    top1 = float((got.argmax(-1) == ref.argmax(-1)).double().mean())
    print(f"{name} {type_k}/{type_v} {opts}: logits relative error {err:.3g} (bound {tol}), greedy {same}/{N_NEW} "
          f"tokens equal to DynamicCache, teacher-forced top-1 agreement {top1:.3f}")
    assert err <= tol
    if exact:
        assert torch.equal(tokens, ref_tokens)
        assert top1 == 1.0


@pytest.mark.parametrize("name", MODELS)
def test_batch_with_left_padding_equals_each_row_alone(name):
    # row 0: 11 pads then 26 tokens; row 1: 37 tokens. Each row's greedy tokens with KVQCache f32 in
    # one batch equal that row generated alone with DynamicCache + eager (no padding).
    ids = prompt_ids(37, batch=2, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :11] = 0
    ids[0, :11] = 0
    m = model(name, "eager")
    alone = [greedy(m, ids[b:b + 1, 11 * (1 - b):], DynamicCache(config=m.config), 9) for b in range(2)]
    m = model(name, "kvq")
    cache = kvq_cache(m, type_k="f32", type_v="f32")
    with torch.no_grad():
        out = m.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=9, min_new_tokens=9,
                         do_sample=False, pad_token_id=0)[:, 37:]
    for b in range(2):
        assert torch.equal(out[b:b + 1], alone[b])
    assert cache.kv.n_pos(0) == 26 + 8 and cache.kv.n_pos(1) == 37 + 8  # padding is not stored
    assert cache.get_seq_length() == 37 + 8


def test_batch_without_padding_uses_one_sequence_per_row():
    ids = prompt_ids(19, batch=3, seed=6)
    m = model("llama", "eager")
    ref = greedy(m, ids, DynamicCache(config=m.config), 6)
    m = model("llama", "kvq")
    cache = kvq_cache(m, type_k="f16", type_v="f16")
    assert torch.equal(greedy(m, ids, cache, 6), ref)
    assert cache.kv.n_seq == 3 and [cache.kv.n_pos(s) for s in range(3)] == [24] * 3


def test_bfloat16_model_attends_in_float32():
    m = model("llama", "eager")
    ids = prompt_ids(21, seed=7)
    with torch.no_grad():
        ref = m.to(torch.bfloat16)(ids, past_key_values=DynamicCache(config=m.config)).logits.double()
        m.set_attn_implementation("kvq")
        got = m(ids, past_key_values=kvq_cache(m, type_k="f32", type_v="f32")).logits
    m.to(torch.float32)
    assert got.dtype == torch.bfloat16
    err = rel(got.double(), ref)
    print(f"bf16 model, KVQCache f32 vs DynamicCache: logits relative error {err:.3g}")
    assert err < 0.02  # bf16 rounding of the attention output (8 bits of mantissa)


def test_crop_then_continue_equals_fresh():
    m = model("llama", "kvq")
    ids = prompt_ids(30, seed=8)
    # q8 without the K channel scale (calibrated on a sequence's first append, which differs here)
    a = kvq_cache(m, type_k="q8", type_v="q8", k_channel_scale=False)
    b = kvq_cache(m, type_k="q8", type_v="q8", k_channel_scale=False)
    with torch.no_grad():
        m(ids, past_key_values=a)
        a.crop(-7)
        assert a.get_seq_length() == 23 and a.kv.n_pos() == 23
        la = m(ids[:, 23:], past_key_values=a).logits
        m(ids[:, :23], past_key_values=b)
        lb = m(ids[:, 23:], past_key_values=b).logits
    torch.testing.assert_close(la, lb, rtol=0, atol=0)
    a.reset()
    assert a.get_seq_length() == 0 and a.kv.n_pos() == 0 and a.bytes_used() == 0


def test_bytes_used_of_a_4bit_cache_below_f16():
    m = model("qwen2", "kvq")
    ids = prompt_ids(64, seed=9)
    used = {}
    for t in ("f16", "kivi4"):
        c = kvq_cache(m, type_k=t, type_v="q4a" if t == "kivi4" else t, kivi_residual=0 if t == "kivi4" else 32)
        with torch.no_grad():
            m(ids, past_key_values=c)
        used[t] = c.bytes_used()
    # f16: 3 layers x 64 positions x 2 kv heads x 64 x (K, V) x 2 bytes
    assert used["f16"] == 3 * 64 * 2 * 64 * 2 * 2
    assert used["kivi4"] < 0.35 * used["f16"]


# --- the exceptions documented in kvq.hf and README "From Python" --------------------------------


def test_bad_options_raise_at_construction():
    m = model("llama", "kvq")
    with pytest.raises(ValueError, match="unknown K cache type 'q5'"):
        kvq_hf.KVQCache(m.config, type_k="q5")
    with pytest.raises(TypeError, match="unexpected keyword argument 'typek'"):
        kvq_hf.KVQCache(m.config, typek="q4")
    cfg = Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(ValueError, match=r"\[KVQCache\] every layer must be full_attention"):
        kvq_hf.KVQCache(cfg)


def test_update_checks_shape_dtype_and_device():
    m = model("llama", "kvq")
    c = kvq_cache(m)
    good = torch.zeros(1, 2, 3, 32)
    with pytest.raises(ValueError, match=r"key_states: expected shape \(batch, 2, n_tokens, 32\), got \(1, 3, 3, 32\)"):
        c.update(torch.zeros(1, 3, 3, 32), good, 0)
    with pytest.raises(TypeError, match=r"value_states: dtype torch.int64, expected a floating-point tensor"):
        c.update(good, torch.zeros(1, 2, 3, 32, dtype=torch.int64), 0)
    with pytest.raises(TypeError, match=r"key_states: expected a torch.Tensor, got ndarray"):
        c.update(good.numpy(), good, 0)
    with pytest.raises(TypeError, match="on meta, kvq's cache runs on the CPU"):
        c.update(good.to("meta"), good, 0)
    with pytest.raises(ValueError, match=r"key_states \(1, 2, 3, 32\) and value_states \(1, 2, 4, 32\) differ"):
        c.update(good, torch.zeros(1, 2, 4, 32), 0)


def test_wrong_attention_or_cache_raises():
    m = model("llama", "sdpa")
    ids = prompt_ids(5)
    with pytest.raises(ValueError, match=r"attn_implementation='sdpa'; a KVQCache needs 'kvq'"):
        with torch.no_grad():
            m(ids, past_key_values=kvq_cache(m))
    m = model("llama", "kvq")
    with pytest.raises(ValueError, match=r"attends on a kvq.hf.KVQCache: pass past_key_values"):
        with torch.no_grad():
            m(ids, past_key_values=DynamicCache(config=m.config))


def test_context_past_max_cache_len_raises():
    m = model("llama", "kvq")
    c = kvq_cache(m, n_ctx=16)
    with torch.no_grad():
        m(prompt_ids(10), past_key_values=c)
        with pytest.raises(ValueError, match=r"n_ctx is 16 .*max_cache_len=16"):
            m(prompt_ids(7), past_key_values=c)


def test_custom_4d_mask_raises():
    m = model("llama", "kvq")
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match=r"attention_mask: expected the 2-D padding mask"):
        with torch.no_grad():
            m(prompt_ids(5), attention_mask=mask, past_key_values=kvq_cache(m))


def test_unsupported_transformers_version_raises_import_error():
    # import kvq.hf runs this check on transformers.__version__
    kvq_hf.check_transformers_version(transformers.__version__)
    for v in ("4.57.1", "6.0.0"):
        with pytest.raises(ImportError, match=rf"kvq.hf supports transformers .*; found {v} at "):
            kvq_hf.check_transformers_version(v)


# --- the real model --------------------------------------------------------------------------------


def test_qwen25_coder_gguf_greedy_32_tokens_equal_dynamic_cache():
    pytest.importorskip("gguf", reason="the gguf package is not installed (scripts/install-deps.sh)")
    pytest.importorskip("accelerate", reason="accelerate (transformers' GGUF loader needs it) is not installed "
                        "(scripts/install-deps.sh)")
    path = SOURCE_DIR / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if not path.exists():
        pytest.skip(f"{path} not found (scripts/fetch-models.sh models)")
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(THREADS)
    # kvq's tokenizer (equal to llama.cpp's on the golden files) spares transformers' slow GGUF
    # tokenizer conversion; the weights are transformers' own dequantization to float32
    engine = kvq.Model(str(path))
    ids = torch.tensor([engine.tokenize("// C++: the n-th Fibonacci number, iterative\nint fibonacci(int n) {")])
    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    m.set_attn_implementation("sdpa")
    ref = greedy(m, ids, DynamicCache(config=m.config), 32)
    m.set_attn_implementation("kvq")
    n_ctx = ids.shape[1] + 32
    same = {}
    for t_k, t_v, opts in [("f32", "f32", {}), ("kivi4", "q4a", {"sink": 4})]:
        out = greedy(m, ids, kvq_cache(m, n_ctx, type_k=t_k, type_v=t_v, **opts), 32)
        same[t_k] = int((out == ref).cumprod(1).sum())
        print(f"Qwen2.5-Coder-0.5B (GGUF, f32 weights), {ids.shape[1]}-token prompt: KVQCache {t_k}/{t_v} {opts} "
              f"greedy {same[t_k]}/32 tokens equal to DynamicCache + sdpa")
    print(repr(engine.detokenize(ref[0].tolist())))
    assert same["f32"] == 32
