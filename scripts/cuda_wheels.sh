# Sourced (bash) by .ci/run and scripts/gpu_b1_ratio.sh: the pinned NVIDIA wheels that give a
# machine without CUDA an nvcc (and CI its SASS tools), in directories reused across runs.
#
#   . scripts/cuda_wheels.sh
#   ensure_nvcc            # sets NVCC_BIN, installing the pinned nvcc 13.0 wheels when missing
#   pip_home DIR PKG...    # a fresh DIR holding the packages (a venv, or `pip --target DIR/site`
#                          # where python3 has no venv module)
#   find_cu13 DIR TOOL     # prints the path of a cu13 wheel's TOOL under a pip_home DIR

pip_home() {
  local home="$1"; shift
  rm -rf "$home"
  if python3 -m venv "$home" >/dev/null 2>&1 && [ -x "$home/bin/pip" ]; then
    "$home/bin/pip" install -q --disable-pip-version-check "$@"
  else
    rm -rf "$home"
    python3 -m pip install -q --disable-pip-version-check --target "$home/site" "$@"
  fi
}

find_cu13() {
  for f in "$1"/lib/python3*/site-packages/nvidia/cu13/bin/"$2" "$1"/site/nvidia/cu13/bin/"$2"; do
    if [ -x "$f" ]; then echo "$f"; return 0; fi
  done
  return 1
}

# nvcc 13.0.88 in $TM_NVCC_HOME (default ~/.cache/tm/nvcc-13.0.88), matching the GPU machine's
# driver; the same pins as xtask's `PIP_PACKAGES` (crates/xtask/src/kernels.rs).
ensure_nvcc() {
  local home="${TM_NVCC_HOME:-$HOME/.cache/tm/nvcc-13.0.88}"
  NVCC_BIN="$(find_cu13 "$home" nvcc || true)"
  if [ -z "$NVCC_BIN" ] || ! "$NVCC_BIN" --version | grep -q "V13.0.88"; then
    pip_home "$home" "nvidia-cuda-nvcc==13.0.88" "nvidia-nvvm==13.0.88" "nvidia-cuda-crt==13.0.88" \
      "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85"
    NVCC_BIN="$(find_cu13 "$home" nvcc)" || { echo "error: nvcc is missing from $home after pip install" >&2; return 1; }
  fi
}
