#!/usr/bin/env bash
# Runs a command down the code paths an AVX2-only CPU (AMD Zen 3) takes, on a CPU that has AVX-512 or AMX:
#   torch's own kernels at its AVX2 level (ATEN_CPU_CAPABILITY), oneDNN's and MKL's capped at AVX2, and ragkv's C++
#   kernels compiled for znver3 (a compiler wrapper turns -march=native into -march=znver3) into a build folder of
#   their own, so the native builds stay as they are. Kernels that need AVX-512 BF16 or AMX then report themselves
#   unavailable and their callers keep the torch path, as on a Zen 3.
# The paths are Zen 3's; the cores, caches and memory are still this machine's: compare figures taken under it with
# each other (one checkout against another, ragkv against transformers), not with a Zen 3's.
#   usage: bash scripts/as_avx2.sh .venv/bin/ragkv bench engine --dtypes float32
set -euo pipefail
[[ $# -gt 0 ]] || { echo "usage: $0 COMMAND [ARGS...]" >&2; exit 2; }

real_cxx=${CXX:-c++}
wrap_dir=$(mktemp -d)
trap 'rm -rf "$wrap_dir"' EXIT
cat >"$wrap_dir/c++" <<EOF
#!/usr/bin/env bash
args=()
for a in "\$@"; do [[ \$a == -march=native ]] && a=-march=znver3; args+=("\$a"); done
exec $real_cxx "\${args[@]}"
EOF
chmod +x "$wrap_dir/c++"

export CXX="$wrap_dir/c++"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}/as-avx2"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
export RAGKV_ISA_EMULATED=avx2  # recorded with every figure taken under it (and in the kernel choices' key)
"$@"
