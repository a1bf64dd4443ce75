"""A backend that answers at once: for measuring what fleetsched itself costs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ..errors import InvalidRequest
from .base import Backend, ChatBody, Chunk, estimate_prompt_tokens, make_chunk, new_completion_id, requested_max_tokens, usage_dict, wants_continuous_usage
from .chat_options import check_chat_options
from .sampling import MAX_LOGPROBS, check_sampling, lax_int, requested_top_logprobs

#: The log probability of each token the instant backend answers; ``top_logprobs`` lists the
#: token, then others less likely (-4, -5, ...): a fixed, valid distribution, as the sim's.
TOKEN_LOGPROB = -0.1
_OTHERS = [(f" t{i:02d}", -4.0 - i) for i in range(MAX_LOGPROBS - 1)]


def answer_logprobs(text: str, count: int, top: int) -> dict[str, list[dict[str, Any]]]:
    """A choice's ``logprobs`` as vLLM gives them, for an answer of `count` tokens whose text is
    `text`: an entry a token (its text, log probability, bytes, and `top` alternatives, the token
    first), the whole text the first token's and none the others' (the tokens join to the text)."""
    entries = []
    for token in [text, *[""] * (count - 1)] if count else []:
        alternatives = [(token, TOKEN_LOGPROB), *_OTHERS][:top]
        entries.append(
            {
                "token": token, "logprob": TOKEN_LOGPROB, "bytes": list(token.encode()),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in alternatives],
            }  # fmt: skip
        )
    return {"content": entries}


class InstantBackend(Backend):
    """Streams a fixed one-chunk answer without yielding to the event loop.

    `completion_tokens` tokens are reported as produced (capped by the request's max_tokens, the
    finish reason then "length", as vLLM ends an answer cut at max_tokens), with their log
    probabilities where the call asks for them (`answer_logprobs`).
    """

    name = "instant"

    def __init__(self, completion_tokens: int = 16, text: str = "ok") -> None:
        self.completion_tokens = completion_tokens
        self.text = text

    async def stream_chat(self, body: ChatBody) -> AsyncIterator[Chunk]:
        """Refuses what the sim refuses of a body (`InvalidRequest`, naming the field): a call
        that runs here must not be refused by a real engine for its form."""
        cid = new_completion_id(body)
        model = body.get("model") or "instant"
        max_tokens = requested_max_tokens(body)
        prompt = estimate_prompt_tokens(body)
        if "prompt" not in body and not body.get("messages"):
            raise InvalidRequest("messages: a chat request needs a non-empty list of messages")
        if body.get("n") is not None and lax_int(body["n"]) != 1:  # "1" is 1, as vLLM reads it
            raise InvalidRequest(f"n: the instant backend produces one choice per request (n=1), got n={body['n']!r}")
        check_sampling(body, max_tokens)
        check_chat_options(body)
        top = requested_top_logprobs(body)
        n = min(self.completion_tokens, max_tokens)
        finish = "length" if n < self.completion_tokens else "stop"  # its usage says max_tokens were made
        # The count on the answer's chunk too where the call asks for it on every chunk, as vLLM
        # sends it (the dispatcher always asks; a gateway client asking saw none on this backend).
        usage = usage_dict(prompt, n) if wants_continuous_usage(body) else None
        chunk = make_chunk(cid, model, 0, role="assistant", content=self.text, finish_reason=finish, usage=usage)
        if top is not None:  # as vLLM gives them (they were null: a caller that reads them failed here alone)
            chunk["choices"][0]["logprobs"] = answer_logprobs(self.text, n, top)
        yield chunk
        yield make_chunk(cid, model, 0, usage=usage_dict(prompt, n))  # as vLLM: no choices
