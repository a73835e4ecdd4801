#!/bin/sh
# Installs kvq's build and test dependencies from Debian 12 packages (run as root).
set -e
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends \
  build-essential cmake pkg-config git ca-certificates \
  libopenblas-dev nlohmann-json3-dev libcli11-dev libfmt-dev libpcre2-dev libcpp-httplib-dev \
  libgtest-dev libgmock-dev libbenchmark-dev \
  python3 python3-pip python3-dev python3-venv python3-numpy python3-matplotlib python3-yaml python3-tqdm python3-requests >/dev/null
# The gguf Python package (llama.cpp's gguf-py) is the independent reference the weight dequantizer
# tests compare against (tests/core/gguf_dequant_ref.py). Debian has no package for it; its
# dependencies come from apt above, so pip adds only gguf itself (PEP 668: system interpreter).
python3 -m pip install --quiet --disable-pip-version-check --break-system-packages --no-deps 'gguf==0.19.0'
# kvq server's end-to-end test talks to it through the official OpenAI client, and checks chat
# rendering against jinja2 (tests/server/test_server_openai.py; scripts/render_chat_templates.py).
python3 -m pip install --quiet --disable-pip-version-check --break-system-packages 'openai>=1.40' 'jinja2>=3.1'
# The Python module (python/, README "From Python"): nanobind bindings built by scikit-build-core
# (`pip install .` fetches both into its own build environment; these copies let README command 2
# build and test the module with the python3 on PATH), numpy for its arrays, pytest for its tests.
python3 -m pip install --quiet --disable-pip-version-check --break-system-packages \
  'nanobind>=2.4' 'scikit-build-core>=0.10' 'pytest>=7' numpy
# kvq.hf (python/kvq/hf.py: a transformers Cache on kvq's compressed cache) and its tests
# (tests/python/test_hf.py): torch and transformers from PyPI, pinned to the versions the tests ran
# on (kvq.hf.SUPPORTED_TRANSFORMERS); accelerate is what transformers needs to load a GGUF file.
# PyPI's Linux torch wheel brings the nvidia-* CUDA wheels: about 3.0 GB downloaded, 5.3 GB
# installed, 2 min 20 s on the 2-core CI machine (README "From Python").
python3 -m pip install --quiet --disable-pip-version-check --break-system-packages \
  'torch==2.15.0' 'transformers==5.23.0' 'accelerate==1.15.0'
