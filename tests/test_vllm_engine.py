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


@pytest.mark.vllm
def test_an_engine_setting_vllm_refuses_is_named_as_the_setting(tmp_path):
    """`fleetsched run` on a model of 2,048 positions, backend.engine_max_model_len left at its
    default of 4,096: vLLM said "User-specified max_model_len (4096) is greater than the derived
    max_model_len" and advised an environment variable, to a user who had set nothing."""
    require_vllm_setup()
    model = tmp_path / "model"
    model.mkdir()
    for part in model_path().iterdir():
        (model / part.name).symlink_to(part)
    config = json.loads((model_path() / "config.json").read_text())
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    settings = tmp_path / "engine.toml"
    settings.write_text(
        f'[backend]\nkind = "vllm-engine"\nengine_model_path = "{model}"\n'
        '[tenants.a]\n[[workload.agents]]\ntenant = "a"\ncount = 1\nprompt_tokens = 10\nmax_tokens = 4\n'
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(
        [str(venv_path() / "bin" / "python"), "-m", "fleetsched", "run", str(settings), "--no-live"],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert "(in the settings: backend.engine_max_model_len = 4096 is vLLM's max_model_len)" in done.stderr, done.stderr[-3000:]


@pytest.mark.anyio
async def test_a_model_directory_that_does_not_exist_is_named_with_its_setting(tmp_path):
    """vLLM took the path for a Hub name: "Repo id must be in the form 'repo_name' or
    'namespace/repo_name'", which said neither that the directory is missing nor which setting."""
    from fleetsched.backends.vllm_engine import VLLMEngineBackend
    from fleetsched.errors import BackendUnavailable
    from fleetsched.settings import BackendSettings

    missing = tmp_path / "no-model"
    backend = VLLMEngineBackend.from_settings(BackendSettings(kind="vllm-engine", engine_model_path=str(missing)))
    with pytest.raises(BackendUnavailable, match=f"^vLLM engine for '{missing}' failed to start: backend.engine_model_path: no such directory$"):
        await backend.start()
    with pytest.raises(BackendUnavailable, match="backend.model: no such directory"):
        await VLLMEngineBackend.from_settings(BackendSettings(kind="vllm-engine", model="./no/such/model")).start()
