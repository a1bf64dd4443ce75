"""The simulated KV cache: a pool of fixed-size blocks with prefix caching (vLLM v1's BlockPool).

Blocks are plain ints. A block is either held (reference count > 0) or free; free blocks sit in
one LRU queue, oldest first, and allocation takes from its head. A free block may still carry the
hash of the prompt block it holds: a later request with the same prefix reuses it (a prefix cache
hit) until allocation evicts it. Requests free their blocks tail first, so the tail of a chain is
evicted before its head, and a freed block that carries no hash goes to the head of the queue
(reused before any cached block), as vLLM does.

Several blocks may cache the same hash (two requests computed the same prompt block before
either could hit the other's): as vLLM's ``BlockHashToBlockMap``, all of them are kept, a lookup
finds the oldest, and when it is evicted the next one takes its place.

Invariant (checked by `check()`): ``free + held == num_blocks`` and every cached hash maps to a
block that carries it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ..base import content_part_texts, tool_call_texts

#: Characters per simulated token: matches `estimate_prompt_tokens` (about 4 a token).
CHARS_PER_TOKEN = 4
#: Text of one simulated output token (4 characters: one token by `estimate_prompt_tokens`).
TOKEN_TEXT = " tok"


#: Each role's 16-character frame (see `prompt_text`), made once.
_FRAMES: dict[str, str] = {}


def prompt_text(messages: Sequence[Any], framed: bool = True) -> str:
    """The prompt as one string whose length is what `estimate_prompt_tokens` counts.

    Each message is framed by 16 characters standing for role and chat-template tokens, so that
    the same conversation always yields the same text and therefore the same block hashes
    (`framed` False: none, for a text completion's prompt, which has no template). An
    assistant's tool calls count their names and arguments (`tool_call_texts`).
    Raises `TypeError` (or `AttributeError`) for a message vLLM's server refuses: one that is
    not a mapping, a role that is not a string, content of another type (`invalid_messages`
    names which).
    """
    parts: list[str] = []
    for message in messages:
        role = message.get("role")
        frame = _FRAMES.get(role)
        if frame is None:
            if not isinstance(role, str):
                raise TypeError
            frame = _FRAMES[role] = _frame(role)
        if framed:
            parts.append(frame)
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(content_part_texts(content))
        elif content is not None:
            raise TypeError
        calls = message.get("tool_calls")
        if calls:
            parts.extend(tool_call_texts(calls))
    return "".join(parts)


def _frame(role: str) -> str:
    return f"<|{role}|>".ljust(16)[:16]


def block_hashes(text: str, block_size: int, num_tokens: int) -> list[int]:
    """Hash chain over the full blocks of a prompt: block i's hash covers blocks 0..i."""
    span = block_size * CHARS_PER_TOKEN
    hashes: list[int] = []
    parent = 0
    for i in range(num_tokens // block_size):
        parent = hash((parent, text[i * span : (i + 1) * span]))
        hashes.append(parent)
    return hashes


def answer_lead(text: str, framed: bool = True) -> str:
    """The text an answer follows in the next prompt: the prompt's `text`, then, for a chat
    prompt (`framed`), the assistant message's frame that `prompt_text` writes before the answer.
    A text completion's answer follows its prompt directly: a client sends prompt + answer next."""
    return text + _frame("assistant") if framed else text


def extend_hashes(hashes: list[int], text: str, answer: str, block_size: int, num_blocks: int) -> None:
    """Extend a prompt's hash chain (`hashes`, from `block_hashes` of its prompt) over its
    `answer` (its text as the next turn's prompt holds it), to `num_blocks` blocks at most.
    `text` is what the answer follows (`answer_lead` of the prompt's text).

    The answer's blocks are hashed as the next turn's prompt will hold them: `prompt_text` of the
    conversation with the answer as the assistant's message (the sim answers `TOKEN_TEXT` a token,
    or a tool call, which that prompt holds as its name and arguments), or, for a text
    completion, the prompt followed by the answer.
    So that turn hits them, as it hits vLLM's, which hashes every block once full, generated
    tokens included (measured on the tiny CPU model, 128-token blocks: a 298-token prompt and a
    128-token answer, then the next turn's prompt hit 384 tokens, one block more than the prompt's).
    """
    if num_blocks <= len(hashes):
        return
    span = block_size * CHARS_PER_TOKEN
    text = text + answer
    parent = hashes[-1] if hashes else 0
    for i in range(len(hashes), min(num_blocks, len(text) // span)):
        parent = hash((parent, text[i * span : (i + 1) * span]))
        hashes.append(parent)


class BlockPool:
    """Fixed-size blocks, reference counted, with an LRU free queue and a prefix-hash map."""

    __slots__ = ("num_blocks", "block_size", "_ref", "_hash", "_free", "_cached", "_copies")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        # OrderedDict as an O(1) intrusive list: popitem(last=False) is the LRU end, del is O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # hash -> the oldest block caching it
        self._copies: dict[int, list[int]] = {}  # hash -> the other blocks caching it, oldest first

    @property
    def num_free(self) -> int:
        """Blocks that allocation may take (never-used and cached-but-unreferenced alike)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Blocks caching the longest prefix of `hashes` (at most `max_blocks`). Touches nothing."""
        hits: list[int] = []
        cached = self._cached
        for h in hashes[:max_blocks]:
            block = cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_evictable(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` are free (so taking them shrinks the free queue)."""
        ref = self._ref
        count = 0
        for b in blocks:  # a loop, not sum() over a generator: about half the instructions
            if ref[b] == 0:
                count += 1
        return count

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached `blocks` (prefix hits), pulling free ones off the queue."""
        ref, free = self._ref, self._free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n: int, out: list[int]) -> None:
        """Append `n` fresh blocks to `out`, evicting LRU cached blocks. Caller checked num_free."""
        free, ref, hashes = self._free, self._ref, self._hash
        for _ in range(n):
            b = free.popitem(last=False)[0]
            h = hashes[b]
            if h is not None:
                self._evict(b, h)
            ref[b] = 1
            out.append(b)

    def _evict(self, block: int, h: int) -> None:
        """Forget that `block` caches `h`; the oldest other block caching `h` (if any) is hit next."""
        self._hash[block] = None
        copies = self._copies.get(h)
        if copies is None:  # the only block caching h: the common case
            del self._cached[h]
            return
        if self._cached[h] == block:
            self._cached[h] = copies.pop(0)
        else:
            copies.remove(block)
        if not copies:
            del self._copies[h]

    def cache(self, block: int, h: int) -> None:
        """Record that `block` holds the prompt block hashed `h` (besides any other block that does)."""
        if self._hash[block] is not None:
            return
        self._hash[block] = h
        if self._cached.setdefault(h, block) != block:
            self._copies.setdefault(h, []).append(block)

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each of `blocks`, tail first. As vLLM's ``free_blocks``, an
        unreferenced block that caches a prompt block joins the end of the queue (evicted last,
        LRU) and one that caches nothing (it can never be a hit) its front, to be reused first:
        it spares the cached blocks."""
        ref, free, hashes = self._ref, self._free, self._hash
        reuse_first: list[int] = []
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                if hashes[b] is None:
                    reuse_first.append(b)
                else:
                    free[b] = None
        for b in reversed(reuse_first):  # at the front in the order freed (vLLM's prepend_n)
            free[b] = None
            free.move_to_end(b, last=False)

    def check(self) -> None:
        """Assert the pool's invariants (for tests)."""
        held = sum(1 for r in self._ref if r > 0)
        assert held + len(self._free) == self.num_blocks, (held, len(self._free))
        assert all(self._ref[b] == 0 for b in self._free)
        for h, b in self._cached.items():
            assert self._hash[b] == h
        for h, blocks in self._copies.items():
            assert blocks and h in self._cached and all(self._hash[b] == h for b in blocks)
        assert sum(h is not None for h in self._hash) == len(self._cached) + sum(map(len, self._copies.values()))
