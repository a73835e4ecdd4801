#!/usr/bin/env python3
"""Reference values for kvq's weight dequantizers from the gguf Python package (PyPI `gguf`, an
independent implementation of llama.cpp's dequantize_row_*). Called by tests/core/test_weight_types.cpp.

  gguf_dequant_ref.py blocks TYPE IN OUT   raw blocks of ggml type TYPE (name, e.g. q4_k) in IN ->
                                           their values as little-endian f32 in OUT
  gguf_dequant_ref.py model GGUF OUT       one line per tensor of GGUF: name, type, n, hash, where
                                           hash = sum_i bits(v_i) * (2 i + 1) mod 2^64 over the
                                           dequantized values v_i as f32 (bit-exact comparison)

Exit status 77 with a message on stderr when numpy or gguf is missing (the test skips).
"""
import sys

try:
    import numpy as np
    import gguf
    from gguf.quants import dequantize
except ImportError as e:  # the caller skips the test with this message
    print(f"gguf_dequant_ref.py: needs numpy and the gguf package ({e}); "
          "install with scripts/install-deps.sh", file=sys.stderr)
    sys.exit(77)

CHUNK = 1 << 22  # elements hashed at a time (bounds memory on the 136M-element embeddings)


def qtype(name):
    return gguf.GGMLQuantizationType[name.upper()]


def hash_values(v, start):
    bits = v.astype(np.float32).reshape(-1).view(np.uint32).astype(np.uint64)
    idx = np.arange(start, start + bits.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return int(np.sum(bits * (idx * np.uint64(2) + np.uint64(1)), dtype=np.uint64))


def cmd_blocks(tname, src, dst):
    raw = np.fromfile(src, dtype=np.uint8)
    dequantize(raw, qtype(tname)).astype(np.float32).tofile(dst)


def cmd_model(path, dst):
    r = gguf.GGUFReader(path)
    with open(dst, "w") as out:
        for t in r.tensors:
            qt = t.tensor_type
            bs, ts = gguf.GGML_QUANT_SIZES[qt]
            raw = np.asarray(t.data).reshape(-1).view(np.uint8)
            n = int(t.n_elements)
            per = CHUNK // bs * ts  # bytes per chunk, whole blocks
            h, start = 0, 0
            for off in range(0, raw.size, per):
                v = dequantize(raw[off:off + per], qt)
                h = (h + hash_values(v, start)) % (1 << 64)
                start += v.size
            assert start == n, (t.name, start, n)
            out.write(f"{t.name} {qt.name.lower()} {n} {h}\n")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "blocks":
        cmd_blocks(sys.argv[2], sys.argv[3], sys.argv[4])
    elif len(sys.argv) == 4 and sys.argv[1] == "model":
        cmd_model(sys.argv[2], sys.argv[3])
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
