#!/bin/sh
# Installs kvq's build and test dependencies from Debian 12 packages (run as root).
set -e
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends \
  build-essential cmake pkg-config git ca-certificates \
  libopenblas-dev nlohmann-json3-dev libcli11-dev libfmt-dev libpcre2-dev \
  libgtest-dev libgmock-dev libbenchmark-dev \
  python3 python3-pip python3-numpy python3-matplotlib >/dev/null
