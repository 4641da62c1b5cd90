# Sourced by the GPU machine's wgpu scripts (scripts/gpu_vulkan.sh, scripts/gpu_wgpu_profile.sh)
# from the repository root: unpacks the Vulkan loader from the carried `.gl` .debs when none is
# installed, points Vulkan at NVIDIA's ICD when none is registered, and exports
# TM_WGPU_ADAPTER (the first adapter `check-env` lists as NVIDIA, unless already set).
# Needs: OUT (a folder), CLI (tm-cli), a `log` function. Returns 1 when no NVIDIA adapter is found.
if ! ldconfig -p | grep libvulkan.so.1 >/dev/null && [ -d .gl ]; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
    log "Vulkan loader unpacked from .gl"
fi
ldconfig -p | grep libvulkan.so.1 >/dev/null || log "warning: no libvulkan.so.1 after unpacking .gl"
NV_ICD=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if ! ls /usr/share/vulkan/icd.d/*nvidia* /etc/vulkan/icd.d/*nvidia* >/dev/null 2>&1 && [ -f "$NV_ICD" ]; then
    export VK_DRIVER_FILES="$NV_ICD"
    export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
    log "VK_DRIVER_FILES=$NV_ICD"
fi
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv >"$OUT/gpu.txt" 2>&1
timeout 60 "$CLI" check-env >"$OUT/check-env.txt" 2>&1
if [ -z "${TM_WGPU_ADAPTER:-}" ]; then
    TM_WGPU_ADAPTER=$(grep -i nvidia "$OUT/check-env.txt" | grep -o '\[[0-9]*\]' | head -1 | tr -d '[]')
fi
if [ -z "$TM_WGPU_ADAPTER" ]; then
    log "FAIL: no NVIDIA wgpu adapter; check-env says:"
    sed -n '/wgpu adapters/,$p' "$OUT/check-env.txt" | head -8 | tee -a "$OUT/summary.txt"
    return 1
fi
export TM_WGPU_ADAPTER
log "adapter: $(grep -F "[$TM_WGPU_ADAPTER]" "$OUT/check-env.txt" | head -1 | sed 's/^ *//')"
