"""kvq.KVCache against float64 attention computed here with numpy, and its argument checks."""
import math

import pytest

np = pytest.importorskip("numpy", reason="numpy is not installed (pip install numpy)")
kvq = pytest.importorskip("kvq", reason="the kvq module is not importable (pip install . or PYTHONPATH=build/python)")


def attend_f64(k, v, q, pos0, scale):
    """Causal GQA attention in float64: query t at position pos0 + t over keys [0, pos0 + t].
    k, v: [n_pos, n_kv_head, head_dim]; q: [n_tokens, n_head, head_dim]."""
    k, v, q = (np.asarray(a, dtype=np.float64) for a in (k, v, q))
    n_tokens, n_head, _ = q.shape
    grp = n_head // k.shape[1]
    out = np.zeros(q.shape)
    for t in range(n_tokens):
        n = pos0 + t + 1
        for h in range(n_head):
            s = k[:n, h // grp, :] @ q[t, h] * scale
            p = np.exp(s - s.max())
            out[t, h] = p @ v[:n, h // grp, :] / p.sum()
    return out


def rel_err(out, ref):
    """Norm-wise relative error ||out - ref|| / ||ref||."""
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def kv_data(rng, n_pos, n_kv_head, head_dim):
    # Keys with per-channel offsets and spreads (as real K after RoPE), values standard normal.
    off = rng.normal(0, 2, size=(1, n_kv_head, head_dim))
    spread = rng.uniform(0.5, 2, size=(1, n_kv_head, head_dim))
    k = (off + spread * rng.normal(size=(n_pos, n_kv_head, head_dim))).astype(np.float32)
    v = rng.normal(size=(n_pos, n_kv_head, head_dim)).astype(np.float32)
    return k, v


def fill(cache, k, v, chunks):
    """Appends k, v to every layer in chunks of the given sizes (a prompt, then decode steps)."""
    pos = 0
    for n in chunks:
        for layer in range(cache.n_layer):
            cache.append(layer, k[pos:pos + n], v[pos:pos + n])
        pos += n
        assert cache.n_pos() == pos


# (type_k, type_v, tolerance on the norm-wise relative error against float64): about 1.3x the
# worst of n_pos 1 / 17 / 97 measured on this data (f32 2.6e-7, f16 5.1e-4: rounding; q8 8.7e-3,
# q4 0.139, kivi4 K / q4 V 0.125 at 97 positions, f16-exact below its 32-token residual); the C++
# test tests/cache/test_kv_cache_quant.cpp measures the formats on its own data (q8 0.018, q4 0.24).
TOLERANCES = [
    ("f32", "f32", 1e-6),
    ("f16", "f16", 7e-4),
    ("q8", "q8", 0.012),
    ("q4", "q4", 0.18),
    ("kivi4", "q4", 0.17),
]


@pytest.mark.parametrize("type_k,type_v,tol", TOLERANCES)
@pytest.mark.parametrize("n_pos", [1, 17, 97])
def test_attend_matches_float64(type_k, type_v, tol, n_pos):
    rng = np.random.default_rng(n_pos)
    n_layer, n_kv_head, n_head, head_dim = 2, 2, 8, 64  # GQA 4
    k, v = kv_data(rng, n_pos, n_kv_head, head_dim)
    cache = kvq.KVCache(n_layer, n_kv_head, head_dim, 128, type_k=type_k, type_v=type_v)
    prompt = max(1, n_pos - 3)
    fill(cache, k, v, [prompt] + [1] * (n_pos - prompt))
    scale = 1 / math.sqrt(head_dim)
    n_q = min(n_pos, 5)  # the last n_q positions as queries: prefill-like, causal inside the block
    q = rng.normal(size=(n_q, n_head, head_dim)).astype(np.float32)
    pos0 = n_pos - n_q
    for layer in range(n_layer):
        out = cache.attend(layer, q, pos0, scale)
        assert out.shape == (n_q, n_head, head_dim) and out.dtype == np.float32
        ref = attend_f64(k, v, q, pos0, scale)
        err = rel_err(out, ref)
        uniform = rel_err(attend_f64(k, v, q, pos0, 0.0), ref)
        print(f"{type_k}/{type_v} n_pos {n_pos} layer {layer}: relative error {err:.3g} (tolerance {tol}; "
              f"uniform attention {uniform:.3g})")
        assert err <= tol
        if n_pos > 1:
            assert err <= 0.6 * uniform  # better than a cache that lost K


@pytest.mark.parametrize("type_k,type_v", [("f32", "f32"), ("kivi4", "q4a")])
def test_attend_batch_equals_attend_per_sequence(type_k, type_v):
    # 3 sequences of 17, 5 and 30 positions; queries: a prefill chunk at pos0 12, one decode query,
    # and a chunk at position 0: each output equals attend() of that sequence alone, bit for bit, and
    # float64 attention within the format's tolerance (TOLERANCES)
    rng = np.random.default_rng(11)
    n_kv_head, n_head, head_dim = 2, 8, 64
    lens, n_q = [17, 5, 30], [5, 1, 4]
    data = [kv_data(rng, n, n_kv_head, head_dim) for n in lens]
    cache = kvq.KVCache(2, n_kv_head, head_dim, 32, n_seq=4, type_k=type_k, type_v=type_v)
    for s, (k, v) in enumerate(data):
        for layer in range(2):
            cache.append(layer, k, v, s + 1)  # sequences 1, 2, 3
    qs = [rng.normal(size=(n, n_head, head_dim)).astype(np.float32) for n in n_q]
    pos0 = [17 - 5, 5 - 1, 0]
    tol = {"f32": 1e-6, "kivi4": 0.17}[type_k]
    for layer in range(2):
        outs = cache.attend_batch(layer, qs, pos0, 0.125, seq_ids=[1, 2, 3])
        assert len(outs) == 3
        for i, out in enumerate(outs):
            assert out.shape == (n_q[i], n_head, head_dim) and out.dtype == np.float32
            np.testing.assert_array_equal(out, cache.attend(layer, qs[i], pos0[i], 0.125, i + 1))
            assert rel_err(out, attend_f64(*data[i], qs[i], pos0[i], 0.125)) <= tol
    assert cache.attend_batch(0, [], []) == []


def test_attend_batch_argument_errors():
    cache = kvq.KVCache(1, 2, 16, 8, n_seq=2, type_k="f32", type_v="f32")
    z = np.zeros((3, 2, 16), np.float32)
    for s in range(2):
        cache.append(0, z, z, s)
    q = np.zeros((1, 4, 16), np.float32)
    with pytest.raises(ValueError, match=r"\[KVCache.attend_batch\] pos0: 1 positions for 2 query arrays"):
        cache.attend_batch(0, [q, q], [0])
    with pytest.raises(ValueError, match=r"seq_ids: 1 ids for 2 query arrays"):
        cache.attend_batch(0, [q, q], [0, 0], seq_ids=[0])
    with pytest.raises(ValueError, match=r"q\[1\]: n_head 2, q\[0\] has 4"):
        cache.attend_batch(0, [q, np.zeros((1, 2, 16), np.float32)], [0, 0])
    with pytest.raises(ValueError, match=r"seq_id 1 appears twice"):
        cache.attend_batch(0, [q, q], [0, 0], seq_ids=[1, 1])
    with pytest.raises(TypeError, match=r"\[KVCache.attend_batch\] q\[0\]: dtype float64"):
        cache.attend_batch(0, [q.astype(np.float64)], [0])
    with pytest.raises(ValueError, match=r"^\[kv_cache\]"):
        cache.attend_batch(0, [q], [3])  # position 3 not stored


def test_default_scale_is_inverse_sqrt_head_dim():
    rng = np.random.default_rng(1)
    k, v = kv_data(rng, 9, 1, 32)
    cache = kvq.KVCache(1, 1, 32, 16, type_k="f32", type_v="f32")
    fill(cache, k, v, [9])
    q = rng.normal(size=(1, 2, 32)).astype(np.float32)
    assert rel_err(cache.attend(0, q, 8), attend_f64(k, v, q, 8, 1 / math.sqrt(32))) < 1e-6


def test_non_contiguous_inputs_equal_contiguous():
    rng = np.random.default_rng(2)
    k, v = kv_data(rng, 12, 2, 32)
    kt = np.ascontiguousarray(k.transpose(1, 0, 2)).transpose(1, 0, 2)  # same values, other strides
    assert not kt.flags.c_contiguous
    a = kvq.KVCache(1, 2, 32, 16, type_k="q8", type_v="q4")
    b = kvq.KVCache(1, 2, 32, 16, type_k="q8", type_v="q4")
    fill(a, k, v, [12])
    fill(b, kt, v[:, :, ::-1][:, :, ::-1], [12])
    q = rng.normal(size=(3, 4, 64)).astype(np.float32)[:, :, ::2]  # stride 2 on head_dim
    np.testing.assert_array_equal(a.attend(0, q, 9), b.attend(0, np.ascontiguousarray(q), 9))
    np.testing.assert_array_equal(a.attend(0, q, 9), b.attend(0, q, 9))


def test_truncate_then_append_new_tokens():
    rng = np.random.default_rng(3)
    k, v = kv_data(rng, 20, 2, 32)
    k2, v2 = kv_data(rng, 20, 2, 32)
    cache = kvq.KVCache(2, 2, 32, 32, type_k="f32", type_v="f32")
    fill(cache, k, v, [20])
    used = cache.bytes_used()
    cache.truncate(11)
    assert cache.n_pos() == 11 and cache.bytes_used() < used
    for layer in range(2):
        cache.append(layer, k2[11:15], v2[11:15])
    kk, vv = np.concatenate([k[:11], k2[11:15]]), np.concatenate([v[:11], v2[11:15]])
    q = rng.normal(size=(2, 4, 32)).astype(np.float32)
    assert rel_err(cache.attend(1, q, 13, 0.2), attend_f64(kk, vv, q, 13, 0.2)) < 1e-6
    with pytest.raises(ValueError, match=r"\[KVCache.truncate\] n 16"):
        cache.truncate(16)


def test_bytes_used_compressed_below_f16():
    rng = np.random.default_rng(4)
    k, v = kv_data(rng, 64, 2, 64)
    sizes = {}
    for t in ("f16", "q8", "q4"):
        c = kvq.KVCache(2, 2, 64, 64, type_k=t, type_v=t, k_channel_scale=False)
        assert c.bytes_used() == 0
        fill(c, k, v, [64])
        sizes[t] = c.bytes_used()
    # f16: 2 bytes per element; q8 / q4: 8 / 4 bits plus an f16 scale per group of 32 (docs/formats.md)
    elems = 2 * 64 * 2 * 64 * 2  # layers x positions x kv heads x head_dim x (K, V)
    assert sizes["f16"] == elems * 2
    assert sizes["q8"] == elems * (8 + 16 / 32) / 8
    assert sizes["q4"] == elems * (4 + 16 / 32) / 8


class DLPackOnly:
    """An array that offers DLPack only (no buffer protocol), as a torch tensor does."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_dlpack_inputs_equal_buffer_protocol_inputs():
    rng = np.random.default_rng(6)
    k, v = kv_data(rng, 10, 2, 32)
    q = rng.normal(size=(2, 4, 32)).astype(np.float32)
    a = kvq.KVCache(1, 2, 32, 16, type_k="q4", type_v="q8")
    b = kvq.KVCache(1, 2, 32, 16, type_k="q4", type_v="q8")
    fill(a, k, v, [10])
    b.append(0, DLPackOnly(k), DLPackOnly(v))
    np.testing.assert_array_equal(a.attend(0, q, 8), b.attend(0, DLPackOnly(q), 8))


def test_torch_cpu_tensors_when_installed():
    torch = pytest.importorskip("torch", reason="torch is not installed (optional)")
    rng = np.random.default_rng(5)
    k, v = kv_data(rng, 10, 2, 32)
    q = rng.normal(size=(2, 4, 32)).astype(np.float32)
    a = kvq.KVCache(1, 2, 32, 16, type_k="q8", type_v="q8")
    b = kvq.KVCache(1, 2, 32, 16, type_k="q8", type_v="q8")
    fill(a, k, v, [10])
    fill(b, torch.from_numpy(k), torch.from_numpy(v), [10])
    np.testing.assert_array_equal(a.attend(0, q, 8), b.attend(0, torch.from_numpy(q), 8))
    with pytest.raises(TypeError, match="dtype float16"):
        b.attend(0, torch.from_numpy(q).half(), 8)


# --- argument checks: the exceptions README "From Python" documents -----------------------------


@pytest.fixture
def cache():
    c = kvq.KVCache(2, 2, 16, 8, type_k="q8", type_v="q4")
    z = np.zeros((3, 2, 16), np.float32)
    for layer in range(2):
        c.append(layer, z, z)
    return c


def test_wrong_dtype_raises_type_error(cache):
    k = np.zeros((1, 2, 16), np.float64)
    with pytest.raises(TypeError, match=r"\[KVCache.append\] k: dtype float64, expected float32"):
        cache.append(0, k, k.astype(np.float32))
    with pytest.raises(TypeError, match=r"\[KVCache.attend\] q: dtype int32, expected float32"):
        cache.attend(0, np.zeros((1, 2, 16), np.int32), 0)


def test_wrong_shape_raises_value_error_naming_both_shapes(cache):
    good = np.zeros((1, 2, 16), np.float32)
    with pytest.raises(ValueError, match=r"\[KVCache.append\] v: expected shape \(n_tokens, 2, 16\), got \(1, 2, 8\)"):
        cache.append(0, good, np.zeros((1, 2, 8), np.float32))
    with pytest.raises(ValueError, match=r"k: expected shape .* got \(2, 16\)"):
        cache.append(0, np.zeros((2, 16), np.float32), good)
    with pytest.raises(ValueError, match=r"k and v: different n_tokens, 1 and 2"):
        cache.append(0, good, np.zeros((2, 2, 16), np.float32))
    with pytest.raises(ValueError, match=r"\[KVCache.attend\] q: expected shape \(n_tokens, n_head, 16\) with n_head "
                                         r"a multiple of 2, got \(1, 3, 16\)"):
        cache.attend(0, np.zeros((1, 3, 16), np.float32), 0)


def test_wrong_types_raise_type_error(cache):
    with pytest.raises(TypeError):
        cache.append(0, [[[0.0] * 16] * 2], np.zeros((1, 2, 16), np.float32))
    with pytest.raises(TypeError):
        cache.attend("0", np.zeros((1, 2, 16), np.float32), 0)
    with pytest.raises(TypeError):
        cache.attend(0, np.zeros((1, 2, 16), np.float32), 0, "0.25")
    with pytest.raises(TypeError, match="cache option group_size must be an int, got str"):
        kvq.KVCache(1, 1, 16, 8, group_size="16")
    with pytest.raises(TypeError, match="unexpected keyword argument 'typek'"):
        kvq.KVCache(1, 1, 16, 8, typek="q4")


def test_kvq_errors_raise_value_error_with_kvq_message(cache):
    q = np.zeros((1, 2, 16), np.float32)
    with pytest.raises(ValueError, match=r"^\[kv_cache\]"):
        cache.attend(0, q, 3)  # position 3 is not in the cache (3 stored)
    with pytest.raises(ValueError, match=r"^\[kv_cache\]"):
        cache.attend(2, q, 0)  # no layer 2
    with pytest.raises(ValueError, match=r"unknown K cache type 'q5'"):
        kvq.KVCache(1, 1, 16, 8, type_k="q5")
    with pytest.raises(ValueError, match=r"^\[kv_cache\]"):
        kvq.KVCache(1, 1, 12, 8, type_k="q4")  # head_dim not a multiple of 8
    with pytest.raises(ValueError, match=r"^\[kv_cache\]"):
        kvq.KVCache(0, 1, 16, 8)
    big = np.zeros((6, 2, 16), np.float32)
    with pytest.raises(ValueError, match=r"^\[kv_cache\]"):
        cache.append(0, big, big)  # 3 + 6 positions > n_ctx 8


def test_channel_calib_positions_are_attended_exactly_until_calibrated():
    # docs/formats.md: with the K channel scale on, a sequence's first channel_calib positions are
    # kept until the append that completes them; queries before that attend them uncompressed (f16
    # distances to position 0 since 5b64630: rel. error 4.7e-4 here, against q4's 0.20).
    rng = np.random.default_rng(7)
    k, v = kv_data(rng, 40, 2, 64)
    q = rng.normal(size=(3, 4, 64)).astype(np.float32)
    staged = kvq.KVCache(1, 2, 64, 64, type_k="q4", type_v="q4", k_channel_scale=True, channel_calib=48)
    early = kvq.KVCache(1, 2, 64, 64, type_k="q4", type_v="q4", k_channel_scale=True, channel_calib=8)
    for c in (staged, early):
        fill(c, k, v, [37])
    ref = attend_f64(k[:40], v[:40], q, 34, 0.125)
    # staged rows are read as f16 distances to position 0 (docs/formats.md): f16 rounding, not q4's error
    e_staged, e_early = rel_err(staged.attend(0, q, 34, 0.125), ref), rel_err(early.attend(0, q, 34, 0.125), ref)
    assert e_staged < 1e-3
    assert e_early > 5 * e_staged  # compressed: q4's error
    with pytest.raises(ValueError, match=r"channel_calib must be >= 1.*got 0"):
        kvq.KVCache(1, 2, 64, 64, type_k="q4", type_v="q4", k_channel_scale=True, channel_calib=0)
    with pytest.raises(TypeError, match=r"channel_calib must be an int"):
        kvq.KVCache(1, 2, 64, 64, channel_calib="256")


def test_certify_budget_is_checked():
    # f16 holds 2 x 2 x 64 x 2 = 512 bytes per token here, q8 K and V with their certified error norms 284
    opts = dict(type_k="q8", type_v="q8", k_channel_scale=False, certify=True)
    kvq.KVCache(1, 2, 64, 64, certify_budget=0.6, **opts)
    with pytest.raises(ValueError, match=r"certify_budget .*0\.5.* below the 284.* bytes/token"):
        kvq.KVCache(1, 2, 64, 64, certify_budget=0.5, **opts)
    with pytest.raises(ValueError, match=r"certify_budget .*got -1"):
        kvq.KVCache(1, 2, 64, 64, certify_budget=-1.0, **opts)
