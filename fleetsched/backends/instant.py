"""A backend that answers at once: for measuring what fleetsched itself costs."""

from __future__ import annotations

from collections.abc import AsyncIterator

from .base import Backend, ChatBody, Chunk, estimate_prompt_tokens, make_chunk, new_completion_id, requested_max_tokens, usage_dict


class InstantBackend(Backend):
    """Streams a fixed one-chunk answer without yielding to the event loop.

    `completion_tokens` tokens are reported as produced (capped by the request's max_tokens).
    """

    name = "instant"

    def __init__(self, completion_tokens: int = 16, text: str = "ok") -> None:
        self.completion_tokens = completion_tokens
        self.text = text

    async def stream_chat(self, body: ChatBody) -> AsyncIterator[Chunk]:
        cid = new_completion_id()
        model = body.get("model") or "instant"
        n = min(self.completion_tokens, requested_max_tokens(body))
        yield make_chunk(cid, model, 0, role="assistant", content=self.text, finish_reason="stop")
        yield make_chunk(cid, model, 0, usage=usage_dict(estimate_prompt_tokens(body), n))  # as vLLM: no choices
