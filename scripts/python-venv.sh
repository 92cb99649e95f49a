#!/usr/bin/env bash
# Prints the path of a Python venv holding NIXL's official Python API (the vendored
# nixl_cu12 1.5.1 wheel, --no-deps, plus numpy), the pinned msgspec and pyzmq that the
# vLLM-protocol tests' Python peer uses, and the pinned cryptography of the side-channel
# attacker's client, creating it (or adding what it lacks) first if needed.
# Location: $NIXL_PY_VENV, else $CARGO_TARGET_DIR/bench-venv (the venv scripts/bench.sh
# uses), else target/bench-venv. Everything but the final path goes to stderr.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
venv=${NIXL_PY_VENV:-$target/bench-venv}
wheel=$root/vendor/nixl/nixl_cu12-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl
if ! "$venv/bin/python" -c 'import numpy, nixl_cu12' 2>/dev/null; then
    py=""
    for candidate in python3.11 python3; do
        if command -v "$candidate" >/dev/null &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
            py=$candidate
            break
        fi
    done
    if [[ -z $py ]]; then
        echo "python-venv: the pinned NIXL wheel needs CPython 3.11; install python3.11" >&2
        exit 1
    fi
    echo "python-venv: creating $venv (numpy + the vendored NIXL wheel, --no-deps)" >&2
    "$py" -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet numpy >&2
    "$venv/bin/pip" install --quiet --no-deps "$wheel" >&2
fi
# The vLLM-protocol peer (tests/py/vllm_peer.py): vLLM 0.33's own wire libraries, pinned.
vllm_pins=(msgspec==0.23.0 pyzmq==27.3.0)
if ! "$venv/bin/python" -c 'import msgspec, zmq, sys
sys.exit((msgspec.__version__, zmq.__version__) != ("0.23.0", "27.3.0"))' 2>/dev/null; then
    echo "python-venv: installing ${vllm_pins[*]} into $venv" >&2
    "$venv/bin/python" -m pip install --quiet "${vllm_pins[@]}" >&2
fi
# The side-channel attacker's client (tests/py/attacker.py): its own HKDF and AEAD, pinned.
crypto_pin=cryptography==46.0.3
if ! "$venv/bin/python" -c 'import cryptography, sys
sys.exit(cryptography.__version__ != "46.0.3")' 2>/dev/null; then
    echo "python-venv: installing $crypto_pin into $venv" >&2
    "$venv/bin/python" -m pip install --quiet "$crypto_pin" >&2
fi
echo "$venv"
