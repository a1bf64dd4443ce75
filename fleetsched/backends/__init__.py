"""Model backends behind one seam (`Backend`): sim, instant, vllm-server, vllm-engine."""

from __future__ import annotations

from ..settings import BackendSettings
from .base import Backend, ChatBody, Chunk, EngineSignals, collect_chat
from .instant import InstantBackend

__all__ = ["Backend", "ChatBody", "Chunk", "EngineSignals", "InstantBackend", "collect_chat", "create_backend"]


def create_backend(settings: BackendSettings) -> Backend:
    """Build the backend `settings.kind` names. Enter it (``async with``) before use."""
    if settings.kind == "instant":
        return InstantBackend()
    if settings.kind == "sim":
        from .sim import SimBackend

        return SimBackend(settings.sim, model=settings.model)
    if settings.kind == "vllm-server":
        from .vllm_server import VLLMServerBackend

        return VLLMServerBackend.from_settings(settings)
    if settings.kind == "vllm-engine":
        from .vllm_engine import VLLMEngineBackend

        return VLLMEngineBackend.from_settings(settings)
    raise ValueError(f"backend.kind: unknown backend {settings.kind!r}")
