"""Sizing sessions from the model: KV-cache bytes per token, per session, and a server's capacity.

- `kv_bytes_per_token(config)`: 2 (K and V) x layers x KV heads x head dim x dtype bytes, from a
  Hugging Face ``config.json`` (a mapping or a path). ``head_dim`` defaults to hidden_size /
  num_attention_heads, the KV heads (``num_key_value_heads`` or another of `KV_HEADS_KEYS`; one
  under Falcon's ``multi_query``) to num_attention_heads (no GQA), the dtype to the FP8 cache a
  quantized checkpoint declares, else the config's ``torch_dtype`` (or ``dtype``; 16 bits for one
  vLLM serves no model in, a float8 checkpoint's), else float16 (`_cache_dtype`). Multimodal
  configs that nest the language model under ``text_config`` are read from there (the root's
  dtype and quantization first, as vLLM does). Fields a model's Hugging Face class fills in when
  its config leaves them out (`CLASS_DEFAULTS`: Gemma's head_dim and window pattern, Qwen3's
  head_dim, Llama's sizes, which LLaVA-1.5's text_config leaves out) are filled in first, as vLLM
  reads them.
  DeepSeek-V2/V3's compressed latent KV (MLA, `MLA_MODEL_TYPES`) is one vector of kv_lora_rank +
  qk_rope_head_dim a token and layer, as vLLM caches it; other models with a ``kv_lora_rank``
  (DeepSeek-V3.2's sparse attention among them) are refused, as are models with Mamba or
  linear-attention layers (`STATEFUL_ARCHITECTURES`) and Gemma 4's layers of two head sizes
  (`PER_LAYER_MODEL_TYPES`). GPT-2's n_layer and the like are read as vLLM reads them
  (`FIELD_ALIASES`). An error about a config read from a file names the file.
- `session_bytes(context_tokens, ...)`: a session's KV memory, tokens rounded up to whole blocks
  of vLLM's ``block_size`` (16 tokens by default). A sliding-window layer (`layer_windows`: Mistral
  7B v0.1, Gemma 2 and 3, gpt-oss) holds at most its window and the tokens of a step in flight,
  as vLLM frees the blocks that fall out of the window. A model that mixes attentions is cached
  by vLLM in groups of layers, some padded (`_cached_layers`), and counted so.
- `parse_vllm_cache_config(metrics_text)` / `read_vllm_kv_capacity(url)`: the KV capacity a vLLM
  server reports on ``/metrics`` (the labels of ``vllm:cache_config_info``); `kv_device` turns it
  into a ``resources.devices`` entry.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

#: Bytes per element of the KV cache, by dtype name (torch's, without the ``torch.`` prefix).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "float": 4, "fp32": 4,
    "float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "int8": 1, "uint8": 1,
}  # fmt: skip

DEFAULT_BLOCK_SIZE = 16

#: Names of the KV head count, in the order vLLM 0.32 looks for them (Falcon, Llama, ChatGLM, Step).
KV_HEADS_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num", "num_attention_groups")

#: Model types whose ``kv_lora_rank`` vLLM 0.32 caches as one latent vector (MLA).
MLA_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_mtp", "kimi_k2", "glm4_moe_lite"})


class _FileConfig(dict[str, Any]):
    """A config read from a file, which it names (`path`) in the errors about its fields."""

    path: Path


def _read(config: Mapping[str, Any] | str | PathLike[str]) -> Mapping[str, Any]:
    """The config as a mapping: read from its file (or the model directory's ``config.json``)
    when given a path, so that a caller reading it twice reads the file once."""
    if isinstance(config, Mapping):
        return config
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    data = _FileConfig(_read_object(path))
    data.path = path
    beside = path.parent / "hf_quant_config.json"  # ModelOpt 0.29 and before kept it apart, as vLLM reads it
    if "quantization_config" not in data and beside.is_file():
        data["quantization_config"] = _read_object(beside)
    return data


def _read_object(path: Path) -> Mapping[str, Any]:
    """The JSON object in the file at `path` (ValueError naming the file when it holds none)."""
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a JSON object of model settings")
    return data


#: Hugging Face's class defaults for the fields that size the KV cache, by ``model_type``
#: (transformers 5.19). Published configs leave some out, and vLLM, which reads a config through
#: its class, fills them in: Gemma 3 12B's ``text_config`` has no ``head_dim`` (256) nor
#: ``sliding_window_pattern`` (6), Gemma 3 4B's no head counts either. Read without them, it was
#: sized at 2.8 times fewer bytes a session than vLLM caches (head_dim 240 from the hidden size,
#: every layer sliding).
CLASS_DEFAULTS: dict[str, dict[str, int]] = {
    "gemma": {"num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256},
    "gemma2": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096},
    "gemma3_text": {
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
    },
    "qwen3": {"head_dim": 128},
    "llama": {"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096},
}  # fmt: skip


#: The names transformers' config classes (and vLLM's own, for ChatGLM) give the fields that size
#: the KV cache in the models vLLM 0.32 serves that name them otherwise (``attribute_map``), by
#: ``model_type``. GPT-2's config.json has n_layer, n_head and n_embd: it was refused for lacking
#: num_hidden_layers, which vLLM reads from n_layer.
FIELD_ALIASES: dict[str, dict[str, str]] = {
    "gpt2": {"num_hidden_layers": "n_layer", "num_attention_heads": "n_head", "hidden_size": "n_embd"},
    "gpt_bigcode": {"num_hidden_layers": "n_layer", "num_attention_heads": "n_head", "hidden_size": "n_embd"},
    "gptj": {"num_hidden_layers": "n_layer", "num_attention_heads": "n_head", "hidden_size": "n_embd"},
    "bloom": {"num_hidden_layers": "n_layer", "num_attention_heads": "n_head"},
    "falcon": {"num_hidden_layers": "n_layer", "num_attention_heads": "n_head"},
    "chatglm": {"num_hidden_layers": "num_layers"},
    "dbrx": {"num_hidden_layers": "n_layers", "num_attention_heads": "n_heads", "hidden_size": "d_model"},
}

#: Architectures vLLM 0.32 runs with Mamba, linear-attention or convolution layers beside (or
#: instead of) attention (its ``IsHybrid`` and ``IsAttentionFree`` models): each request holds
#: a fixed state in those layers, in cache blocks of its own, and only some layers cache K and V.
#: Counted as attention throughout, Qwen3-Next's 48 layers were sized at 4 times its 12
#: attention layers' KV, and a session at fewer blocks than vLLM holds for it.
STATEFUL_ARCHITECTURES = frozenset({
    "BailingMoeV2_5ForCausalLM", "BailingMoeV3ForCausalLM", "BailingMoeV3VLForConditionalGeneration",
    "FalconH1ForCausalLM", "FalconMambaForCausalLM", "GraniteMoeHybridForCausalLM", "JambaForCausalLM",
    "JambaForSequenceClassification", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Lfm2VlForConditionalGeneration",
    "Mamba2ForCausalLM", "MambaForCausalLM", "MiniCPMV4_6ForConditionalGeneration", "NemotronHForCausalLM",
    "NemotronHPuzzleForCausalLM", "NemotronH_Nano_Omni_Reasoning_V3", "NemotronH_Nano_VL_V2",
    "NemotronH_Omni_Reasoning_V3", "NemotronH_Super_Omni_Reasoning_V3", "OlmoHybridForCausalLM",
    "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration", "Zamba2ForCausalLM",
})  # fmt: skip


#: Model types whose layers transformers 5.19 gives sizes of their own (``per_layer_config``), as
#: vLLM caches them: Gemma 4's full-attention layers have a head_dim of 512 (``global_head_dim``)
#: beside the sliding layers' 256, and, with no ``layer_types`` in its config, one layer in six
#: attends in full. Read as one head_dim, every layer sliding, a session of 32k tokens was sized
#: at a fraction of what vLLM holds for it.
PER_LAYER_MODEL_TYPES = frozenset({"gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text"})


def _load(config: Mapping[str, Any] | str | PathLike[str]) -> tuple[Mapping[str, Any], str]:
    """The model's settings (with `CLASS_DEFAULTS` for what they leave out, and the fields of
    `FIELD_ALIASES` under their usual names) and where they were read, for error messages.
    Raises ValueError for a model of `STATEFUL_ARCHITECTURES`."""
    data = _read(config)
    # The file, where it was read from one: "model config: num_hidden_layers ..." named none.
    where = str(data.path) if isinstance(data, _FileConfig) else "model config"
    architectures = data.get("architectures")
    listed = architectures if isinstance(architectures, list) else []
    stateful = [name for name in listed if isinstance(name, str) and name in STATEFUL_ARCHITECTURES]
    if stateful:
        raise ValueError(
            f"{where}: {stateful[0]} has layers that hold a state (Mamba, linear attention) beside those "
            "that cache K and V, which is not modelled"
        )
    if "num_hidden_layers" not in data and isinstance(data.get("text_config"), Mapping):
        merged = dict(data["text_config"])
        root_dtype = data.get("torch_dtype") or data.get("dtype")
        if root_dtype is not None:  # vLLM reads the root's dtype first
            merged["torch_dtype"] = root_dtype
        for key in ("quantization_config", "compression_config"):  # the checkpoint's, for the whole model
            if key in data:
                merged[key] = data[key]
        if data.get("model_type") == "gemma3":  # its text model's, when the text_config omits it
            merged.setdefault("model_type", "gemma3_text")
        elif data.get("model_type") in PER_LAYER_MODEL_TYPES:  # Gemma 4's, as its text model's
            merged.setdefault("model_type", data["model_type"])
        data, where = merged, f"{where} text_config"
    if data.get("model_type") in PER_LAYER_MODEL_TYPES:
        raise ValueError(f"{where}: the layers of model_type {data['model_type']!r} differ in head_dim, which is not modelled")
    defaults = CLASS_DEFAULTS.get(data.get("model_type"))  # type: ignore[arg-type]
    data = {**defaults, **data} if defaults else data
    aliases = FIELD_ALIASES.get(data.get("model_type"))  # type: ignore[arg-type]
    if aliases:
        named = {field: data[alias] for field, alias in aliases.items() if field not in data and alias in data}
        attention = data.get("attn_config")
        if data.get("model_type") == "dbrx" and isinstance(attention, Mapping) and "kv_n_heads" in attention:
            named["num_key_value_heads"] = attention["kv_n_heads"]  # DBRX keeps its KV heads there
        data = {**data, **named}
    return data, where


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of `dtype` ("bfloat16", "torch.float16", "fp8", ...)."""
    name = str(dtype).removeprefix("torch.").lower()
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown KV cache dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}") from None


def kv_bytes_per_token(config: Mapping[str, Any] | str | PathLike[str], *, dtype: str | None = None) -> int:
    """KV-cache bytes one token takes: 2 x layers x KV heads x head dim x dtype bytes.

    For MLA (`MLA_MODEL_TYPES`): layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes.

    `config` is a parsed ``config.json``, its path, or the model directory. `dtype` overrides the
    dtype read from it (`_cache_dtype`; pass the cache dtype when the server's differs, e.g.
    "fp8"; "auto" is the one read). vLLM's ``--dtype auto`` serves a float32 config in 16 bits:
    pass the dtype the server runs. Raises ValueError naming a missing field (and ``text_config``
    when read there) or a file that holds no JSON object, OSError (FileNotFoundError, ...) when
    the file is unread.
    """
    data, where = _load(config)

    def need(key: str) -> int:
        return _need(data, where, key)

    layers = need("num_hidden_layers")
    name = _cache_dtype(data, where, dtype)
    if data.get("kv_lora_rank") is not None:
        model_type = data.get("model_type")
        if model_type not in MLA_MODEL_TYPES:
            raise ValueError(
                f"{where}: kv_lora_rank (compressed latent KV) of model_type {model_type!r} is not modelled; "
                f"known: {', '.join(sorted(MLA_MODEL_TYPES))}"
            )
        # No K and V heads: one latent vector and its rotary part, a token and layer.
        return layers * (need("kv_lora_rank") + need("qk_rope_head_dim")) * dtype_bytes(name)
    heads = need("num_attention_heads")
    kv_key = next((key for key in KV_HEADS_KEYS if data.get(key) is not None), None)
    kv_heads = need(kv_key) if kv_key is not None else heads
    if data.get("multi_query") and not data.get("new_decoder_architecture"):
        kv_heads = 1  # Falcon-7B: one KV head for all (its new architecture ignores the flag)
    if heads % kv_heads:  # grouped-query attention shares each KV head among a whole group
        raise ValueError(f"{where}: {kv_key} {kv_heads} does not divide num_attention_heads {heads}")
    if data.get("head_dim") is not None:
        head_dim = need("head_dim")
    else:
        hidden = need("hidden_size")
        if hidden % heads:
            raise ValueError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    return 2 * layers * kv_heads * head_dim * dtype_bytes(name)


#: The dtypes vLLM serves a model in; from a config's other dtype (a float8 checkpoint's, say)
#: vLLM falls back to a 16-bit one, as for a float32 one under ``--dtype auto``.
MODEL_DTYPES = frozenset({"float16", "bfloat16", "float32"})


def _cache_dtype(data: Mapping[str, Any], where: str, dtype: str | None) -> str:
    """The dtype vLLM caches K and V in, as it resolves its ``--kv-cache-dtype auto``: `dtype`
    where one is given (and not "auto"), else the FP8 cache a quantized checkpoint declares
    (llm-compressor's ``kv_cache_scheme``, ModelOpt's ``kv_cache_quant_algo``), else the model's
    dtype (the config's ``torch_dtype`` or ``dtype``; float16 without one). A config dtype vLLM
    serves no model in (a float8 checkpoint's) is served in 16 bits: 2 bytes. ``--dtype auto``
    serves a float32 config in 16 bits too: pass the dtype the server runs where that is so."""
    if dtype and dtype != "auto":
        return dtype
    quantized = data.get("quantization_config") or data.get("compression_config")  # llm-compressor's older key
    if isinstance(quantized, Mapping):
        declared = _declared_kv_dtype(quantized)
        if declared == "nvfp4":
            raise ValueError(f"{where}: its checkpoint declares an NVFP4 KV cache, which is not modelled; pass the KV cache dtype")
        if declared is not None:
            return declared
    name = next((d for d in (data.get("torch_dtype"), data.get("dtype")) if d and d != "auto"), "float16")
    return name if str(name).removeprefix("torch.").lower() in MODEL_DTYPES else "bfloat16"


def _declared_kv_dtype(quantized: Mapping[str, Any]) -> str | None:
    """The KV cache dtype a checkpoint's ``quantization_config`` declares (vLLM 0.32's
    `get_kv_cache_quant_algo_string` and its attention layers' reading of ``kv_cache_scheme``):
    "fp8", "nvfp4", or None (none, or one vLLM does not know: its "auto")."""
    method = str(quantized.get("quant_method", ""))
    inner = quantized.get("quantization", quantized)
    inner = inner if isinstance(inner, Mapping) else quantized
    producer = quantized.get("producer")
    if (isinstance(producer, Mapping) and producer.get("name") == "modelopt") or "modelopt_quant_config" in inner:
        method = "modelopt"  # vLLM names the method of a ModelOpt checkpoint that does not
    if method.startswith("modelopt"):
        keys = ("kv_cache_scheme", "kv_cache_quant_algo")
        algo = next((part[key] for key in keys for part in (inner, quantized) if part.get(key)), None)
        if isinstance(algo, Mapping):
            if algo.get("num_bits") == 8 and algo.get("type") == "float" and algo.get("dynamic") is False:
                return "fp8"
            return "nvfp4" if algo.get("num_bits") == 4 and algo.get("type") == "float" else None
        return str(algo).lower() if isinstance(algo, str) and algo.lower() in ("fp8", "nvfp4") else None
    if quantized.get("kv_cache_scheme") is not None:  # llm-compressor's checkpoints (compressed-tensors)
        return "fp8"
    return None


#: More decoder layers than any model has (the largest published have a few hundred).
MAX_LAYERS = 10_000


def _need(data: Mapping[str, Any], where: str, key: str) -> int:
    """`data`'s `key`, which must be a positive integer (ValueError naming it and `where`)."""
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def layer_windows(config: Mapping[str, Any] | str | PathLike[str]) -> list[int | None]:
    """Each decoder layer's attention as vLLM 0.32 caches it: None for full attention (the whole
    context), else its sliding window in tokens.

    From the config's ``sliding_window`` (none, or 0: no sliding window) and, in this order:
    ``layer_types`` (``"sliding_attention"`` layers slide); ``use_sliding_window`` false (Qwen2:
    none slides) or true with ``max_window_layers`` (the layers from that index slide);
    ``sliding_window_pattern`` N (Gemma 3: every Nth layer is full); Gemma 2 (every other layer
    slides, the first among them); otherwise every layer slides (Mistral 7B v0.1), as vLLM then
    applies the model's window to all. Raises ValueError naming a malformed field.
    """
    data, where = _load(config)
    layers = _need(data, where, "num_hidden_layers")
    if layers > MAX_LAYERS:  # a list of that many entries would not fit in memory
        raise ValueError(f"{where}: num_hidden_layers must be at most {MAX_LAYERS:,}, got {layers:,}")
    window = data.get("sliding_window")
    if window is None or window == 0 or data.get("use_sliding_window") is False:
        return [None] * layers
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"{where}: sliding_window must be a positive integer (or null), got {window!r}")
    types = data.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise ValueError(f"{where}: layer_types must list one type for each of the {layers} layers, got {types!r:.200}")
        return [window if kind == "sliding_attention" else None for kind in types]
    first_sliding = data.get("max_window_layers") if data.get("use_sliding_window") else None
    if first_sliding is not None:
        if not isinstance(first_sliding, int) or isinstance(first_sliding, bool) or first_sliding < 0:
            raise ValueError(f"{where}: max_window_layers must be an integer >= 0, got {first_sliding!r:.80}")
        return [window if i >= first_sliding else None for i in range(layers)]
    pattern = data.get("sliding_window_pattern")
    if pattern is None and data.get("model_type") == "gemma2":
        pattern = 2
    if pattern is not None:
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern <= 0:
            raise ValueError(f"{where}: sliding_window_pattern must be a positive integer, got {pattern!r}")
        return [window if (i + 1) % pattern else None for i in range(layers)]
    return [window] * layers


def session_bytes(
    context_tokens: int,
    config: Mapping[str, Any] | str | PathLike[str] | None = None,
    *,
    bytes_per_token: int | None = None,
    dtype: str | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    in_flight_tokens: int | None = None,
) -> int:
    """KV bytes a session of `context_tokens` holds, in whole blocks of `block_size` tokens.

    Give either `config` (read with `kv_bytes_per_token`) or `bytes_per_token`. With `config`, a
    sliding-window layer (`layer_windows`) is counted as vLLM 0.32 bounds what a request holds in
    it: the window less one token, plus the tokens of the steps in flight, at most the context,
    in blocks, plus one (the window need not start at a block's start). `in_flight_tokens` is the
    server's ``max_num_batched_tokens`` times the batches it runs at once (vLLM's
    ``max_in_flight_tokens``: 2,048 on the CPU build's defaults). Without it the context is taken,
    never less than vLLM holds (a block a sliding layer more than a full one). A model that mixes
    attentions is counted as vLLM groups its layers, padding layers included (`_cached_layers`).
    """
    _count("context_tokens", context_tokens)
    _count("block_size", block_size)
    if in_flight_tokens is not None:
        _count("in_flight_tokens", in_flight_tokens)
    windows: list[int | None] = []
    if bytes_per_token is None:
        if config is None:
            raise ValueError("session_bytes needs a model config or bytes_per_token")
        config = _read(config)
        bytes_per_token = kv_bytes_per_token(config, dtype=dtype)
        windows = layer_windows(config)
    _count("bytes_per_token", bytes_per_token)
    blocks = -(-context_tokens // block_size)
    if not any(windows):
        return blocks * block_size * bytes_per_token
    held = context_tokens if in_flight_tokens is None else in_flight_tokens
    layer_blocks = sum(
        layers * (blocks if w is None else -(-min(w - 1 + held, context_tokens) // block_size) + 1)
        for w, layers in _cached_layers(windows).items()
    )
    return layer_blocks * block_size * (bytes_per_token // len(windows))


def _cached_layers(windows: list[int | None]) -> dict[int | None, int]:
    """The layers vLLM 0.32 caches for each attention of `windows` (a window, or None for full),
    padding included: its hybrid cache splits each attention's layers into groups of
    `_group_size` and pads the last group, the padding holding blocks as the group's layers do.
    3 sliding and 2 full layers are cached as 4 and 2; Gemma 3 27B's 52 sliding and 10 full as 60
    and 10."""
    size = _group_size(windows)
    return {w: -(-n // size) * size for w, n in Counter(windows).items()}


def _group_size(windows: list[int | None]) -> int:
    """Layers in one of vLLM 0.32's KV cache groups for a model whose layers attend as `windows`
    say: the fewest layers of any attention, or the most when that is under 1.5 times the fewest
    (``_get_kv_cache_groups_uniform_page_size``). One vLLM block is a page of that many layers."""
    counts = Counter(windows).values()
    return max(counts) if max(counts) < min(counts) * 1.5 else min(counts)


def _count(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be an integer > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class KVCacheCapacity:
    """A vLLM server's KV cache: `num_gpu_blocks` blocks of `block_size` tokens (of every layer,
    or, on a model that mixes attentions, of one cache group's layers: `kv_page_size`), of which
    `usable_blocks` go to requests."""

    num_gpu_blocks: int
    block_size: int
    #: Every label of ``vllm:cache_config_info``, as strings.
    labels: Mapping[str, str]
    #: Blocks the engine never gives a request: vLLM's block pool holds back one, its null block
    #: (block 0). Counted as the cache's, the pool admitted one block more than requests can hold:
    #: 6 sessions of 8 blocks into 48 blocks of which 47 were free, and one of them was preempted.
    held_back: int = 0

    @property
    def tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    @property
    def usable_blocks(self) -> int:
        return self.num_gpu_blocks - self.held_back


_SAMPLE = re.compile(r"^vllm:cache_config_info\{(?P<labels>.*)\}\s+\S+", re.MULTILINE)
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse_vllm_cache_config(metrics_text: str) -> KVCacheCapacity:
    """Read ``vllm:cache_config_info`` from a vLLM server's ``/metrics`` text (Prometheus format).

    Reads ``num_gpu_blocks`` (or, failing that, ``kv_cache_size_tokens`` / ``block_size``). A
    data-parallel server exports one sample per engine, each holding the server's total (its
    front end sums the engines' blocks into one cache config), so they are not added up; the
    smallest is read, should they differ. Raises ValueError when the metric is absent or lacks
    usable numbers (vLLM reports "None" before the engine has profiled memory).
    """
    samples = [
        {key: _unescape(value) for key, value in _LABEL.findall(m.group("labels"))} for m in _SAMPLE.finditer(metrics_text)
    ]
    if not samples:
        raise ValueError("no vllm:cache_config_info sample in the metrics text; is this a vLLM server's /metrics?")
    blocks = min(_blocks(labels) for labels in samples)
    return KVCacheCapacity(blocks, _number(samples[0], "block_size"), samples[0], held_back=1)  # the null block


def _blocks(labels: Mapping[str, str]) -> int:
    """The blocks one ``vllm:cache_config_info`` sample reports."""
    block_size = _number(labels, "block_size")
    if _number(labels, "num_gpu_blocks", required=False):
        return _number(labels, "num_gpu_blocks")
    if tokens := _number(labels, "kv_cache_size_tokens", required=False):
        if tokens < block_size:
            raise ValueError(f"vllm:cache_config_info: kv_cache_size_tokens ({tokens}) holds no whole block of block_size ({block_size})")
        return tokens // block_size
    return _number(labels, "num_gpu_blocks")  # raises, naming the label


def _number(labels: Mapping[str, str], key: str, *, required: bool = True) -> int:
    raw = labels.get(key)
    try:
        value = int(float(raw)) if raw is not None else 0
    except (ValueError, OverflowError):  # not a number, or inf
        value = 0
    if value <= 0 and required:
        raise ValueError(f"vllm:cache_config_info: {key} is {raw!r}, not a positive number")
    return value


async def read_vllm_kv_capacity(url: str, *, client: Any = None) -> KVCacheCapacity:
    """The KV capacity a live vLLM server reports: GET ``{url}/metrics``, then `parse_vllm_cache_config`.

    `url` is the server root (``http://host:port``, no ``/v1``). `client` is an
    ``httpx.AsyncClient`` to reuse (one is made otherwise). Raises ValueError as the parser does,
    and httpx's errors when the server does not answer.
    """
    import httpx

    if client is None:
        async with httpx.AsyncClient(timeout=10.0) as own:
            return await read_vllm_kv_capacity(url, client=own)
    response = await client.get(f"{url.rstrip('/')}/metrics")
    response.raise_for_status()
    return parse_vllm_cache_config(response.text)


def kv_device(
    name: str, capacity: KVCacheCapacity, config: Mapping[str, Any] | str | PathLike[str], *, dtype: str | None = None
) -> dict[str, Any]:
    """A ``resources.devices`` entry for a vLLM server's KV cache: its usable blocks (all but the
    null block) x `kv_page_size`.

    Declare one per replica (``ResourceSettings(devices=[kv_device(...)], page_size=...)``); with
    ``page_size`` = `kv_page_size` a pool page is one vLLM block, so reservations round up
    exactly as the engine allocates. A model that mixes attentions (sliding-window and full
    layers, or windows of two sizes) has blocks of a cache group's layers, not of the whole
    model: the tiny model with one layer of each reported 8,192 blocks of 128 tokens in 1 GiB,
    4,096 blocks of both layers.
    """
    return {"name": name, "memory": capacity.usable_blocks * kv_page_size(capacity, config, dtype=dtype)}


@dataclass(frozen=True, slots=True)
class KVPool:
    """A memory pool sized from KV caches (`kv_pool`)."""

    #: Bytes of each cache, by replica name: the pool's devices.
    devices: dict[str, int]
    #: One KV block (`kv_page_size`): the pool's page.
    page_size: int
    #: What a session of the context budget reserves (`session_bytes`).
    session_bytes: int


def kv_pool(
    capacities: Mapping[str, KVCacheCapacity],
    config: Mapping[str, Any] | str | PathLike[str],
    *,
    context_tokens: int,
    dtype: str | None = None,
    in_flight_tokens: int | None = None,
) -> KVPool:
    """The pool over the KV caches of `capacities` (by replica name) for the model of `config`,
    a session of `context_tokens` reserving what vLLM would hold for it. Raises ValueError when
    the replicas' blocks differ (one pool has one page size), or as `session_bytes` does."""
    if not capacities:
        raise ValueError("kv_pool needs the KV cache of at least one replica")
    config = _read(config)
    pages = {name: kv_page_size(capacity, config, dtype=dtype) for name, capacity in capacities.items()}
    if len(set(pages.values())) > 1:
        raise ValueError(f"the replicas' KV blocks differ ({', '.join(f'{n}: {b:,} B' for n, b in pages.items())}): serve one block size")
    block_size = next(iter(capacities.values())).block_size
    return KVPool(
        devices={name: capacity.usable_blocks * pages[name] for name, capacity in capacities.items()},
        page_size=next(iter(pages.values())),
        session_bytes=session_bytes(context_tokens, config, dtype=dtype, block_size=block_size, in_flight_tokens=in_flight_tokens),
    )


def kv_page_size(capacity: KVCacheCapacity, config: Mapping[str, Any] | str | PathLike[str], *, dtype: str | None = None) -> int:
    """Bytes of one KV block of the server: block_size tokens x the model's bytes per token, or,
    for a model that mixes attentions (as `kv_device` says), x the bytes of a cache group's layers
    (`_group_size`), vLLM's page."""
    config = _read(config)
    windows = layer_windows(config)
    per_token = kv_bytes_per_token(config, dtype=dtype)
    if len(set(windows)) > 1:
        per_token = per_token // len(windows) * _group_size(windows)
    return capacity.block_size * per_token
