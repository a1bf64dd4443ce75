"""The OpenAI-compatible multi-tenant gateway (``fleetsched serve``).

`Gateway` is the ASGI app; `fleetsched.gateway.server` runs it on uvicorn. See `app` for what a
request goes through, `auth` for API keys, `state` for what instances share, `sessions` for
``X-Session-ID``.
"""

from .app import Gateway
from .auth import KeyRing, hash_key
from .state import MemoryState, Placement, RedisState, SharedState, create_state

__all__ = ["Gateway", "KeyRing", "MemoryState", "Placement", "RedisState", "SharedState", "create_state", "hash_key"]
