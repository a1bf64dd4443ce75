"""The in-process vLLM backend, run in the vLLM virtualenv (vLLM is not in the main one)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from fleetsched.testing.fixtures import require_vllm_setup
from fleetsched.testing.vllm_server import REPO_ROOT, model_path, venv_path


@pytest.mark.vllm
def test_engine_backend_streams_and_aborts_in_process():
    require_vllm_setup()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run(
        [str(venv_path() / "bin" / "python"), "-m", "fleetsched.testing.engine_smoke", str(model_path())],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=420,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert result["ok"], f"{result}\n{proc.stderr[-3000:]}"
    assert result["usage"]["completion_tokens"] == 12
    # An engine kept to the exit by a call's exception was shut down again by its __del__ there.
    assert "Exception ignored" not in proc.stderr, proc.stderr[-3000:]


def test_engine_options_that_repeat_an_argument_of_its_own_are_refused_naming_it():
    """It was Python's "dict() got multiple values for keyword argument 'max_model_len'"."""
    from fleetsched.backends.vllm_engine import VLLMEngineBackend

    with pytest.raises(ValueError, match=r"^engine_options: dtype, max_model_len: set by the backend's own arguments"):
        VLLMEngineBackend("m", engine_options={"max_model_len": 512, "dtype": "half", "seed": 1})
    assert VLLMEngineBackend("m", engine_options={"seed": 1}).engine_args["seed"] == 1


@pytest.mark.anyio
async def test_calls_that_name_no_model_name_the_one_the_engine_serves():
    """A scheduler asks its backend which model to name (`served_model`); this backend said
    none, so its calls named the settings' default, which the engine refuses as unknown."""
    from fleetsched.backends.vllm_engine import VLLMEngineBackend

    assert await VLLMEngineBackend("path/to/model").served_model() == "path/to/model"
    assert await VLLMEngineBackend("path/to/model", served_model_name="tiny").served_model() == "tiny"
