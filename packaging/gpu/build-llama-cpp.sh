#!/usr/bin/env bash
# Build llama-cpp-python for a GPU backend into a wheel, once: `make test-gpu` and the README's GPU section use it.
#   packaging/gpu/build-llama-cpp.sh vulkan|cuda WHEEL_DIR
# The wheel is cached in WHEEL_DIR (a later run with a wheel there builds nothing). pip's own wheel cache is not
# used: it keys the build by the source alone, so a CPU wheel built earlier would come back in place of this one.
#
# vulkan: needs the Vulkan loader, glslc and a driver (on Debian/Ubuntu: mesa-vulkan-drivers libvulkan-dev glslc
#   vulkan-tools spirv-headers; installed here when run as root). llama.cpp's Vulkan backend needs headers >= 1.3.272
#   (`vk::LayerSettingEXT`); Debian 12 ships 1.3.239, so the headers of Debian 13's libvulkan-dev are unpacked
#   beside the wheel (dpkg-deb -x, nothing installed) and given to CMake. Newer systems use their own.
# cuda: needs nvcc on the PATH; CMAKE_CUDA_ARCHITECTURES (default: the local GPU's, "native") narrows the build.
set -euo pipefail
backend=${1:?backend: vulkan or cuda}
wheels=${2:?wheel directory}
python=${PYTHON:-python3}
spec=${LLAMA_CPP_PYTHON:-llama-cpp-python>=0.3.36}
mkdir -p "$wheels"
if ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "llama-cpp-python ($backend): cached wheel $(ls "$wheels"/llama_cpp_python-*.whl)"
  exit 0
fi
args=${CMAKE_ARGS:-}
case " $args " in *GGML_RPC*) ;; *) args="$args -DGGML_RPC=ON" ;; esac  # layers on other machines, as the CPU build
case "$backend" in
  vulkan)
    missing=()
    command -v glslc >/dev/null || missing+=(glslc)
    [ -e /usr/include/vulkan/vulkan.h ] || missing+=(libvulkan-dev)
    command -v vulkaninfo >/dev/null || missing+=(vulkan-tools)
    ls /usr/share/vulkan/icd.d/*.json >/dev/null 2>&1 || missing+=(mesa-vulkan-drivers)
    [ -d /usr/include/spirv ] || missing+=(spirv-headers)
    if [ ${#missing[@]} -gt 0 ]; then
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
      else
        echo "missing for the Vulkan build: ${missing[*]} (Debian/Ubuntu: sudo apt-get install ${missing[*]})" >&2
        exit 2
      fi
    fi
    header_version=$(sed -n 's/^#define VK_HEADER_VERSION \([0-9]*\).*/\1/p' /usr/include/vulkan/vulkan_core.h)
    if [ "${header_version:-0}" -lt 272 ]; then
      headers="$wheels/vulkan-headers"
      if [ ! -e "$headers/usr/include/vulkan/vulkan.hpp" ]; then
        echo "Vulkan headers 1.3.$header_version are too old for llama.cpp (needs 272): taking Debian 13's"
        scratch=$(mktemp -d)
        mkdir -p "$scratch/lists/partial"
        echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
          >"$scratch/sources.list"
        apt_opts=(-o "Dir::Etc::SourceList=$scratch/sources.list" -o Dir::Etc::SourceParts=/dev/null
                  -o "Dir::State::Lists=$scratch/lists" -o Debug::NoDropPrivs=1 -o APT::Sandbox::User=root)
        apt-get "${apt_opts[@]}" update -q >/dev/null
        (cd "$scratch" && apt-get "${apt_opts[@]}" download libvulkan-dev >/dev/null)
        dpkg-deb -x "$scratch"/libvulkan-dev_*.deb "$headers"
        rm -rf "$scratch"
      fi
      args="$args -DVulkan_INCLUDE_DIR=$(cd "$headers/usr/include" && pwd)"
    fi
    args="-DGGML_VULKAN=on $args"
    ;;
  cuda)
    command -v nvcc >/dev/null || { echo "nvcc is not on the PATH (CUDA toolkit)" >&2; exit 2; }
    args="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CMAKE_CUDA_ARCHITECTURES:-native} $args"
    ;;
  *) echo "unknown backend $backend (vulkan or cuda)" >&2; exit 2 ;;
esac
echo "building $spec for $backend: CMAKE_ARGS=$args"
start=$(date +%s)
CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  "$python" -m pip wheel --no-deps --no-cache-dir --no-binary llama-cpp-python -w "$wheels" "$spec"
echo "built in $(( $(date +%s) - start )) s: $(ls "$wheels"/llama_cpp_python-*.whl)"
