#!/usr/bin/env bash
# Install SGLang's two real routers, pinned, for tests/test_routers.py (and for trying corral's
# local engine behind them by hand):
#
#   scripts/routers_venv.sh [DIR]    # DIR defaults to ${CORRAL_ROUTERS_VENV:-/var/cache/corral-routers}
#
# Creates two venvs, DIR/sglang-router (sglang-router==$SGLANG_ROUTER_VERSION) and DIR/smg
# (smg==$SMG_VERSION, the SGLang Model Gateway), each skipped when already there at its pinned
# version, and prints two lines, `sglang-router=PATH` and `smg=PATH`, the two CLIs.
#
# Why two venvs: the Python packages would coexist (distinct modules `sglang_router` and `smg`,
# no dependency clash), but sglang-router 0.3.2 also installs console scripts named `smg` and
# `amg` that start *its own* CLI, so in a shared venv `bin/smg` is whichever package was
# installed last.
#
# Both are prebuilt Rust binaries inside their wheels (manylinux, no compiler needed).
# Measured on the 2-core dev box: about 30 s and 280 MB in all with a cold pip cache.
set -euo pipefail

dir="${1:-${CORRAL_ROUTERS_VENV:-/var/cache/corral-routers}}"
python="${PYTHON:-python3}"
sglang_router_version="${SGLANG_ROUTER_VERSION:-0.3.2}"
smg_version="${SMG_VERSION:-1.13.0}"

# install VENV DIST VERSION MODULE: a venv holding exactly DIST==VERSION (importable as MODULE).
install() {
    local venv="$1" dist="$2" version="$3" module="$4"
    if [ -x "$venv/bin/python" ] && [ "$("$venv/bin/python" -c \
        "import importlib.metadata as m; print(m.version('$dist'))" 2>/dev/null)" = "$version" ]; then
        return 0
    fi
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "$dist==$version" >&2
    "$venv/bin/python" -c "import $module" >&2
}

mkdir -p "$dir"
install "$dir/sglang-router" sglang-router "$sglang_router_version" sglang_router
install "$dir/smg" smg "$smg_version" smg

echo "sglang-router=$(cd "$dir/sglang-router/bin" && pwd)/sglang-router"
echo "smg=$(cd "$dir/smg/bin" && pwd)/smg"
