"""kvq.hf: kvq's compressed KV cache inside Hugging Face transformers models.

- ``KVQCache(model.config, type_k="kivi4", type_v="q4a", sink=4)``: a ``transformers.Cache`` whose
  layers keep K and V in one ``kvq.KVCache`` (compressed formats stay compressed).
- ``attn_implementation="kvq"`` (registered in transformers' ``AttentionInterface`` on import): the
  attention of each layer runs in kvq on that cache (prefill and decode, causal, GQA, the layer's own
  ``scaling``), so no full-precision copy of the history is ever made: the cache's ``update`` only
  keeps a reference to the new chunk's K / V, which the attention appends to kvq, then attends on.

Usage::

    import kvq.hf
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="kvq")  # or model.set_attn_implementation("kvq")
    cache = kvq.hf.KVQCache(model.config, type_k="kivi4", type_v="q4a", sink=4, max_cache_len=4096)
    model.generate(**inputs, past_key_values=cache, max_new_tokens=64)

Supported: decoder-only models whose layers are all "full_attention" (Llama, Qwen2, Mistral without
sliding window, ...) on the CPU, float32 / float16 / bfloat16 activations (K, V and queries go to kvq
as float32, the output comes back in the query's dtype), batches with left (or any) padding through
the 2-D attention mask. Not supported, with a clear error: sliding-window or soft-capped attention,
attention sinks (s_aux), 4-D / custom masks, dropout in training, beam search (reorder_cache), CUDA
tensors. Errors: ``ValueError`` for a model or input kvq cannot serve, ``TypeError`` for a wrong
dtype or device, ``NotImplementedError`` for the cache operations kvq does not have.

transformers versions: SUPPORTED_TRANSFORMERS, >=5.22,<5.24 (tests/python/test_hf.py, the real-model
test included, passed on TESTED_TRANSFORMERS: 5.22.2 and 5.23.0); importing this module with another
version raises ImportError naming both.
"""
from __future__ import annotations

import weakref

import torch
import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from . import KVCache

# The Cache / CacheLayerMixin API (transformers 5: layers with update / get_seq_length /
# get_mask_sizes / get_max_length, the attention interface receiving the 2-D mask of an unknown
# implementation as is) this module is written against, and the versions its tests ran on.
SUPPORTED_TRANSFORMERS = SpecifierSet(">=5.22,<5.24")
TESTED_TRANSFORMERS = ("5.22.2", "5.23.0")



def check_transformers_version(version: str) -> None:
    """Raises ImportError naming the supported range when `version` is outside it."""
    if Version(version) not in SUPPORTED_TRANSFORMERS:
        raise ImportError(
            f"kvq.hf supports transformers {SUPPORTED_TRANSFORMERS} (tested: {', '.join(TESTED_TRANSFORMERS)}); "
            f"found {version} at {transformers.__file__} (pip install 'transformers{SUPPORTED_TRANSFORMERS}')")


check_transformers_version(transformers.__version__)

from transformers import AttentionInterface  # noqa: E402
from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function  # noqa: E402

__all__ = ["KVQCache", "KVQLayer", "kvq_attention_forward", "SUPPORTED_TRANSFORMERS", "TESTED_TRANSFORMERS"]

_KVQ_TAG = "_kvq_layer"  # attribute of the key tensor update() returns: the KVQLayer that holds it


class KVQLayer(CacheLayerMixin):
    """One model layer of a KVQCache: layer `layer_idx` of the shared kvq.KVCache.

    update() keeps a reference to the new K / V chunk (no copy) and returns it, tagged with this layer;
    kvq_attention_forward appends the chunk's unpadded rows to kvq and attends on the cache. Lengths:
    `n_tokens` counts transformers' positions (padding included, as its masks and cache_position do),
    `kv_len[b]` the rows kvq holds for batch row b (padding left out).
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False

    @property
    def owner(self) -> "KVQCache":
        return self._owner()

    def __init__(self, owner: "KVQCache", layer_idx: int):
        super().__init__()
        self._owner = weakref.ref(owner)  # no reference cycle: the cache (and kvq's memory) goes with its last user
        self.layer_idx = layer_idx
        self.n_tokens = 0
        self.kv_len: list[int] = []
        self.pending = None  # (k, v) of the last update, until the attention appends it

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        # empty [batch, n_kv_head, 0, head_dim]: what transformers reads off a layer (dtype, device, batch)
        self.keys = key_states.new_empty((b, h, 0, d))
        self.values = value_states.new_empty((b, h, 0, d))
        self.batch_size = b
        self.kv_len = [0] * b
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        owner = self.owner
        owner._check_attn_implementation()
        if self.pending is not None or (self.layer_idx > 0 and owner.layers[self.layer_idx - 1].pending is not None):
            raise RuntimeError(
                "[KVQCache] the keys of a layer were not consumed by the kvq attention: load the model with "
                "attn_implementation='kvq' (or call model.set_attn_implementation('kvq')) to use a KVQCache")
        owner._check_kv(key_states, "key_states")
        owner._check_kv(value_states, "value_states")
        if key_states.shape != value_states.shape:
            raise ValueError(f"[KVQCache.update] key_states {tuple(key_states.shape)} and value_states "
                             f"{tuple(value_states.shape)} differ")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner._ensure_kv(key_states.shape[0])
        if key_states.shape[0] != self.batch_size:
            raise ValueError(f"[KVQCache.update] batch size {key_states.shape[0]}, the cache holds {self.batch_size} "
                             "sequences (a new batch needs a new KVQCache or reset())")
        self.pending = (key_states, value_states, self.n_tokens)
        self.n_tokens += key_states.shape[2]
        setattr(key_states, _KVQ_TAG, self)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.n_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n_tokens + query_length, 0

    def get_max_length(self) -> int:
        return self.owner.max_cache_len

    def reset(self) -> None:
        self.n_tokens = 0
        self.kv_len = [0] * len(self.kv_len)
        self.pending = None

    def offload(self):
        pass

    def prefetch(self):
        pass

    def crop(self, tokens_to_remove: int) -> None:
        self.owner.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx):
        if self.n_tokens > 0:
            raise NotImplementedError("[KVQCache] reorder_cache (beam search) is not supported")

    def batch_repeat_interleave(self, repeats: int):
        if self.n_tokens > 0:
            raise NotImplementedError("[KVQCache] batch_repeat_interleave of a filled cache is not supported")

    def batch_select_indices(self, indices):
        if self.n_tokens > 0:
            raise NotImplementedError("[KVQCache] batch_select_indices of a filled cache is not supported")


class KVQCache(Cache):
    """A transformers Cache whose K and V live in kvq's compressed cache (one kvq.KVCache, one kvq
    layer per model layer, one kvq sequence per batch row), for ``attn_implementation="kvq"``.

    config: the model's config (``model.config``; its text config for multimodal models): n_layer =
    num_hidden_layers, n_kv_head = num_key_value_heads, head_dim = head_dim or hidden_size /
    num_attention_heads. Every layer must be "full_attention" (ValueError otherwise).
    max_cache_len: positions per sequence, allocated up front (kvq sizes its cache for n_ctx: see
    ``bytes()``); default config.max_position_embeddings. A longer sequence raises ValueError.
    n_threads: kvq's attention threads; default torch.get_num_threads().
    Cache options, spelled as the CLI's KV flags (kvq.KVCache): type_k ("f32", "f16", "q8", "q4",
    "kivi4", ...; default f16), type_v, rotation, group_size, sink, recent, kivi_group, kivi_residual,
    channel_scale, k_channel_scale, channel_calib, kv_seed. ValueError (kvq's message) for a bad option value,
    TypeError for an unknown option name or a value of the wrong type: both at construction.
    """

    def __init__(self, config, max_cache_len: int | None = None, n_threads: int | None = None, **cache_options):
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        if any(t != "full_attention" for t in layer_types) or getattr(text, "use_sliding_window", False):
            raise ValueError(f"[KVQCache] every layer must be full_attention; this model has {sorted(set(layer_types))}"
                             f"{' and use_sliding_window' if getattr(text, 'use_sliding_window', False) else ''}")
        if getattr(text, "attn_logit_softcapping", None):
            raise ValueError("[KVQCache] attention logit soft-capping is not supported")
        self._config = config
        self.n_layer = text.num_hidden_layers
        n_head = text.num_attention_heads
        self.n_kv_head = getattr(text, "num_key_value_heads", None) or n_head
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // n_head
        self.max_cache_len = int(max_cache_len if max_cache_len is not None else text.max_position_embeddings)
        self.n_threads = torch.get_num_threads() if n_threads is None else int(n_threads)
        self.cache_options = dict(cache_options)
        # Checks the options now (kvq's validation: names, types, values against this head_dim).
        KVCache(1, self.n_kv_head, self.head_dim, 1, n_threads=1, **self.cache_options)
        self.kv: KVCache | None = None  # made on the first update, with one sequence per batch row
        super().__init__(layers=[KVQLayer(self, i) for i in range(self.n_layer)])

    # --- the kvq cache ---------------------------------------------------------------------------

    def _ensure_kv(self, batch_size: int):
        if self.kv is None:
            self.kv = KVCache(self.n_layer, self.n_kv_head, self.head_dim, self.max_cache_len, n_seq=batch_size,
                              n_threads=self.n_threads, **self.cache_options)

    def _check_attn_implementation(self):
        impl = getattr(self._config, "_attn_implementation", "kvq")
        if impl != "kvq":
            raise ValueError(f"[KVQCache] the model attends with attn_implementation={impl!r}; a KVQCache needs "
                             "'kvq' (from_pretrained(..., attn_implementation='kvq') or "
                             "model.set_attn_implementation('kvq') after import kvq.hf)")

    def _check_kv(self, t, name):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"[KVQCache.update] {name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise TypeError(f"[KVQCache.update] {name}: on {t.device}, kvq's cache runs on the CPU")
        if not t.is_floating_point():
            raise TypeError(f"[KVQCache.update] {name}: dtype {t.dtype}, expected a floating-point tensor")
        if t.dim() != 4 or t.shape[1] != self.n_kv_head or t.shape[3] != self.head_dim:
            raise ValueError(f"[KVQCache.update] {name}: expected shape (batch, {self.n_kv_head}, n_tokens, "
                             f"{self.head_dim}), got {tuple(t.shape)}")

    def append_kv(self, key_states, value_states, layer_idx: int) -> None:
        """Stores K / V computed elsewhere (e.g. a prefill saved from another run) in layer layer_idx
        without attending: key_states, value_states [batch, n_kv_head, n_tokens, head_dim] after RoPE,
        no padding. Layers in order, each the same tokens, as a forward pass appends them. Errors as
        update()."""
        layer = self.layers[layer_idx]
        layer.update(key_states, value_states, layer_idx)
        k, v, _ = layer.pending
        layer.pending = None
        kf, vf = (t.detach().to(torch.float32).transpose(1, 2) for t in (k, v))
        for b in range(k.shape[0]):
            self.kv.append(layer_idx, kf[b], vf[b], b)
            layer.kv_len[b] += k.shape[2]

    def bytes_used(self) -> int:
        """Bytes holding the stored positions (all layers, K and V; kvq.KVCache.bytes_used)."""
        return 0 if self.kv is None else self.kv.bytes_used()

    def bytes(self) -> int:
        """Bytes kvq allocated (all layers, K and V, max_cache_len positions per sequence)."""
        return 0 if self.kv is None else self.kv.bytes()

    def describe(self) -> str:
        return KVCache(1, self.n_kv_head, self.head_dim, 1, n_threads=1, **self.cache_options).describe()

    def __repr__(self):
        return (f"KVQCache(n_layer={self.n_layer}, n_kv_head={self.n_kv_head}, head_dim={self.head_dim}, "
                f"max_cache_len={self.max_cache_len}: {self.describe()})")

    # --- Cache operations --------------------------------------------------------------------------

    def reset(self):
        if self.kv is not None:
            for s in range(self.kv.n_seq):
                self.kv.clear(s)
        for layer in self.layers:
            layer.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the last -tokens_to_remove positions (a negative count, as DynamicCache.crop) of every
        sequence. Only when no batch row has padding among the removed positions (else ValueError)."""
        if tokens_to_remove > 0:
            raise ValueError(f"[KVQCache.crop] pass a negative number of tokens to remove, got {tokens_to_remove}")
        n = -tokens_to_remove
        if n == 0 or self.kv is None:
            return
        first = self.layers[0]
        if n > first.n_tokens:
            raise ValueError(f"[KVQCache.crop] {n} tokens to remove, the cache holds {first.n_tokens}")
        for layer in self.layers:
            if layer.pending is not None:
                raise ValueError("[KVQCache.crop] a forward pass is in progress")
        for b in range(self.kv.n_seq):
            pad = first.n_tokens - first.kv_len[b]
            if first.kv_len[b] < n and pad > 0:
                raise ValueError("[KVQCache.crop] cannot remove padded positions")
            self.kv.truncate(first.kv_len[b] - n, b)
        for layer in self.layers:
            layer.n_tokens -= n
            layer.kv_len = [k - n for k in layer.kv_len]


def _unpadded_rows(attention_mask, b, start, n):
    """Indices (a LongTensor) of the non-padded rows among positions [start, start + n) of batch row b,
    or None when all are kept."""
    m = attention_mask[b, start:start + n]
    if bool(m.all()):
        return None
    return torch.nonzero(m, as_tuple=False).flatten()


def kvq_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention of one layer on its KVQCache layer (registered as attn_implementation="kvq").

    query: [batch, n_head, n_tokens, head_dim] after RoPE; key / value: the [batch, n_kv_head,
    n_tokens, head_dim] chunk KVQCache.update returned (its new rows only). attention_mask: None or
    transformers' 2-D padding mask [batch, past + n_tokens] (nonzero = attend); a padded row is neither
    stored nor attended, and its output is 0. Returns ([batch, n_tokens, n_head, head_dim] in the
    query's dtype, None), as transformers' other attention functions. Causal (query t attends to
    the rows up to its own), GQA (n_head a multiple of n_kv_head), logits scaled by `scaling`
    (default 1/sqrt(head_dim)).
    """
    layer = getattr(key, _KVQ_TAG, None)
    if not isinstance(layer, KVQLayer) or layer.pending is None or layer.pending[0] is not key:
        raise ValueError("[kvq attention] attn_implementation='kvq' attends on a kvq.hf.KVQCache: pass "
                         "past_key_values=kvq.hf.KVQCache(model.config, ...) (and use_cache=True)")
    if dropout and module.training:
        raise ValueError("[kvq attention] dropout is not supported (inference only)")
    if not getattr(module, "is_causal", True):
        raise ValueError("[kvq attention] non-causal attention is not supported")
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"[kvq attention] {name}={kwargs[name]!r} is not supported")
    owner, kv = layer.owner, layer.owner.kv
    k, v, start = layer.pending
    layer.pending = None
    batch, n_head, n_tokens, head_dim = query.shape
    if query.device.type != "cpu":
        raise TypeError(f"[kvq attention] query: on {query.device}, kvq's cache runs on the CPU")
    if batch != k.shape[0] or n_tokens != k.shape[2] or head_dim != owner.head_dim:
        raise ValueError(f"[kvq attention] query {tuple(query.shape)} does not match the chunk {tuple(k.shape)} "
                         "the cache received")
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] != layer.n_tokens:
            raise ValueError(f"[kvq attention] attention_mask: expected the 2-D padding mask (batch {batch}, "
                             f"{layer.n_tokens} positions), got shape {tuple(attention_mask.shape)} (4-D and custom "
                             "masks are not supported)")
    scale = float(scaling) if scaling is not None else head_dim ** -0.5
    il = layer.layer_idx
    # the chunk's rows as float32 [n_tokens, heads, head_dim] views (kvq copies strided inputs once)
    kf, vf, qf = (t.detach().to(torch.float32).transpose(1, 2) for t in (k, v, query))
    rows = [None] * batch
    if attention_mask is not None:
        rows = [_unpadded_rows(attention_mask, b, start, n_tokens) for b in range(batch)]
    qs, pos0, seq_ids = [], [], []
    for b in range(batch):
        r = rows[b]
        kb, vb, qb = (kf[b], vf[b], qf[b]) if r is None else (kf[b][r], vf[b][r], qf[b][r])
        if kb.shape[0] == 0:
            continue
        try:
            kv.append(il, kb, vb, b)
        except ValueError as e:
            if "n_ctx" in str(e):
                raise ValueError(f"[KVQCache] {e} (the cache holds max_cache_len={owner.max_cache_len} positions per "
                                 "sequence: pass a larger max_cache_len)") from e
            raise
        qs.append(qb)
        pos0.append(layer.kv_len[b])
        seq_ids.append(b)
        layer.kv_len[b] += kb.shape[0]
    if len(seq_ids) == 1 and batch == 1 and rows[0] is None:
        out = torch.from_numpy(kv.attend(il, qs[0], pos0[0], scale, 0)).unsqueeze(0)
    else:
        outs = kv.attend_batch(il, qs, pos0, scale, seq_ids) if qs else []
        out = torch.zeros((batch, n_tokens, n_head, head_dim), dtype=torch.float32)
        for b, o in zip(seq_ids, outs):
            if rows[b] is None:
                out[b] = torch.from_numpy(o)
            else:
                out[b, rows[b]] = torch.from_numpy(o)
    return out.to(query.dtype), None


def kvq_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
             attention_mask=None, **kwargs):
    """The mask of attn_implementation="kvq" (registered in transformers' AttentionMaskInterface):
    kvq's attention is causal by construction, so the mask is only the 2-D padding mask
    [batch, kv_length] (bool), or None when nothing is padded. ValueError for any other mask pattern
    (sliding window, chunked, packed sequences, bidirectional blocks)."""
    if mask_function is not causal_mask_function:
        raise ValueError(f"[kvq attention] only the causal mask (with padding) is supported, got the mask function "
                         f"{getattr(mask_function, '__name__', mask_function)!r}")
    if attention_mask is None:
        return None
    m = attention_mask[:, kv_offset:kv_offset + kv_length].to(torch.bool)
    if m.shape != (batch_size, kv_length):
        raise ValueError(f"[kvq attention] attention_mask: expected (batch {batch_size}, {kv_length} positions), got "
                         f"shape {tuple(attention_mask.shape)}")
    return None if bool(m.all()) else m


AttentionInterface.register("kvq", kvq_attention_forward)
AttentionMaskInterface.register("kvq", kvq_mask)
