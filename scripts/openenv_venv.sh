#!/usr/bin/env bash
# Create a separate venv holding openenv-core (OpenEnv's client and server), kept apart from
# corral's own environment because openenv-core pulls heavy deps (gradio, fastmcp,
# huggingface_hub, openai>=2.7) that may conflict with ours.
#
#   scripts/openenv_venv.sh [DIR]        # DIR defaults to .openenv-venv (the tests' default)
#
# Then: CORRAL_OPENENV_PYTHON=DIR/bin/python pytest tests/test_openenv_compat.py
#       CORRAL_OPENENV_PYTHON=DIR/bin/python python bench/envs.py
# Measured on the 2-core dev box: about 65 s and 474 MB for openenv-core 0.3.0.
set -euo pipefail

dir="${1:-.openenv-venv}"
python="${PYTHON:-python3}"
version="${OPENENV_CORE_VERSION:-0.3.0}"

start=$(date +%s)
"$python" -m venv "$dir"
"$dir/bin/pip" install --quiet --disable-pip-version-check "openenv-core==$version"
"$dir/bin/python" -c "import openenv.core, openenv.core.env_server.http_server"
end=$(date +%s)

echo "openenv-core $version installed in $dir in $((end - start)) s ($(du -sh "$dir" | cut -f1))"
echo "use it with: export CORRAL_OPENENV_PYTHON=$(cd "$dir" && pwd)/bin/python"
