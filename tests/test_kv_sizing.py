import json

import pytest

from fleetsched.resources import kv_bytes_per_token, parse_vllm_cache_config, session_bytes
from fleetsched.resources.kv_sizing import dtype_bytes, layer_windows

LLAMA3_8B = {
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}


def test_llama3_8b_is_128_kib_per_token():
    assert kv_bytes_per_token(LLAMA3_8B) == 2 * 32 * 8 * 128 * 2 == 131072


def test_defaults_head_dim_and_kv_heads():
    config = {"hidden_size": 768, "num_attention_heads": 12, "num_hidden_layers": 12, "torch_dtype": "float32"}
    assert kv_bytes_per_token(config) == 2 * 12 * 12 * 64 * 4


def test_explicit_head_dim_wins_and_dtype_override():
    config = {**LLAMA3_8B, "head_dim": 256}
    assert kv_bytes_per_token(config) == 2 * 32 * 8 * 256 * 2
    assert kv_bytes_per_token(config, dtype="fp8") == 2 * 32 * 8 * 256


def test_reads_file_dir_and_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16", "text_config": {**LLAMA3_8B, "torch_dtype": None}}))
    assert kv_bytes_per_token(tmp_path) == kv_bytes_per_token(tmp_path / "config.json") == 131072


def test_missing_dtype_defaults_to_float16_and_unknown_dtype_raises():
    config = dict(LLAMA3_8B)
    del config["torch_dtype"]
    assert kv_bytes_per_token(config) == 131072
    assert dtype_bytes("torch.float32") == 4
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        kv_bytes_per_token(config, dtype="float13")


def test_missing_field_is_named():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        kv_bytes_per_token({"hidden_size": 8, "num_attention_heads": 2})


def test_session_bytes_rounds_to_blocks():
    assert session_bytes(1, bytes_per_token=100) == 16 * 100
    assert session_bytes(16, bytes_per_token=100) == 16 * 100
    assert session_bytes(17, bytes_per_token=100) == 32 * 100
    assert session_bytes(100, LLAMA3_8B, block_size=32) == 128 * 131072
    with pytest.raises(ValueError):
        session_bytes(0, bytes_per_token=1)
    with pytest.raises(ValueError):
        session_bytes(10)


METRICS = r'''# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="27910",num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
'''


def test_parse_cache_config():
    capacity = parse_vllm_cache_config(METRICS)
    assert (capacity.num_gpu_blocks, capacity.block_size) == (27910, 16)
    assert capacity.tokens == 27910 * 16
    assert capacity.labels["cache_dtype"] == "auto"


def test_parse_falls_back_to_tokens():
    text = 'vllm:cache_config_info{block_size="128",engine="0",kv_cache_size_tokens="2560",num_gpu_blocks="None"} 1.0\n'
    assert parse_vllm_cache_config(text).num_gpu_blocks == 20


def test_tokens_that_are_no_whole_number_of_blocks_are_rounded_down():
    text = 'vllm:cache_config_info{block_size="128",engine="0",kv_cache_size_tokens="2600",num_gpu_blocks="None"} 1.0\n'
    assert parse_vllm_cache_config(text).num_gpu_blocks == 20  # a partial block holds no session


def test_a_data_parallel_server_s_blocks_are_counted_once():
    """vLLM's front end sums its engines' blocks into its one cache config, then exports that
    config once per engine (vllm/v1/engine/utils.py, wait_for_engine_startup; loggers.py,
    log_metrics_info): each sample holds the server's total. Before: summed again, a server of
    two engines read as twice its cache, and admission reserved half the memory it needs."""
    text = (
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="54000"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="54000"} 1.0\n'
    )
    assert parse_vllm_cache_config(text).num_gpu_blocks == 54000


def test_parse_errors():
    with pytest.raises(ValueError, match="no vllm:cache_config_info"):
        parse_vllm_cache_config("vllm:num_requests_running 0\n")
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        parse_vllm_cache_config('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n')
    with pytest.raises(ValueError, match="num_gpu_blocks"):  # was an OverflowError
        parse_vllm_cache_config('vllm:cache_config_info{block_size="16",num_gpu_blocks="inf"} 1.0\n')


@pytest.mark.parametrize(
    ("call", "message"),
    [  # before: 0 bytes, negative or float sizes, true taken for one layer, heads that cannot be grouped
        (lambda: session_bytes(100, bytes_per_token=0), "bytes_per_token must be an integer > 0, got 0"),
        (lambda: session_bytes(100, bytes_per_token=1.5), "bytes_per_token must be an integer > 0, got 1.5"),
        (lambda: session_bytes(100.5, bytes_per_token=8), "context_tokens must be an integer > 0"),
        (lambda: session_bytes(100, bytes_per_token=8, block_size=True), "block_size must be an integer > 0"),
        (lambda: kv_bytes_per_token({**LLAMA3_8B, "num_hidden_layers": True}), "num_hidden_layers must be a positive integer"),
        (lambda: kv_bytes_per_token({**LLAMA3_8B, "num_key_value_heads": 5}), "num_key_value_heads 5 does not divide"),
        (lambda: kv_bytes_per_token({**LLAMA3_8B, "num_key_value_heads": 64}), "num_key_value_heads 64 does not divide"),
    ],
)
def test_sizes_that_are_no_counts_are_refused_by_name(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_kv_device_and_page_from_a_server_capacity():
    from fleetsched.resources import KVCacheCapacity, kv_device, kv_page_size
    from fleetsched.settings import ResourceSettings

    tiny = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64, "dtype": "float32"}
    capacity = KVCacheCapacity(48, 128, {})
    device = kv_device("vllm0", capacity, tiny)
    assert device == {"name": "vllm0", "memory": 48 * 128 * 2048}
    assert kv_page_size(capacity, tiny) == 128 * 2048
    settings = ResourceSettings(devices=[device], page_size=kv_page_size(capacity, tiny))
    assert int(settings.devices[0].memory) == 48 * 128 * 2048


def test_the_null_block_a_vllm_server_holds_back_is_left_out_of_its_device():
    """vLLM's block pool holds back one block (its null block) from requests: of 48 reported, 47
    are theirs. The device was all 48, and six sessions of 8 blocks were admitted into 47 (the
    real server then preempted one of them: test_vllm_admission)."""
    from fleetsched.resources import kv_device, kv_pool

    tiny = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64, "dtype": "float32"}
    capacity = parse_vllm_cache_config('vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="48"} 1.0\n')
    assert (capacity.num_gpu_blocks, capacity.tokens, capacity.usable_blocks) == (48, 6144, 47)
    assert kv_device("vllm0", capacity, tiny)["memory"] == 47 * 128 * 2048
    sized = kv_pool({"r0": capacity}, tiny, context_tokens=1024)
    assert sized.devices == {"r0": 47 * 128 * 2048} and sized.devices["r0"] // sized.session_bytes == 5


DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "num_hidden_layers": 61,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
}


def test_mla_caches_one_latent_vector_per_token_and_layer():
    """vLLM caches kv_lora_rank + qk_rope_head_dim values a token and layer for MLA (one KV head,
    no separate V). Before: 2 x 128 heads x 56 (hidden / heads), 1,748,992 bytes, 25 times too many."""
    assert kv_bytes_per_token(DEEPSEEK_V3) == 61 * (512 + 64) * 2 == 70272
    lite = {**DEEPSEEK_V3, "model_type": "deepseek_v2", "num_hidden_layers": 27, "num_attention_heads": 16, "q_lora_rank": None}
    assert kv_bytes_per_token(lite) == 27 * 576 * 2
    assert kv_bytes_per_token(DEEPSEEK_V3, dtype="fp8") == 61 * 576


def test_deepseek_sparse_attention_is_refused_by_name():
    """DeepSeek-V3.2's cache (fp8_ds_mla by default, plus its indexer's keys) is not modelled."""
    with pytest.raises(ValueError, match="kv_lora_rank .* of model_type .deepseek_v32. is not modelled"):
        kv_bytes_per_token({**DEEPSEEK_V3, "model_type": "deepseek_v32", "index_topk": 2048})


def test_falcon_kv_heads_are_read_as_vllm_reads_them():
    """Falcon names its KV heads num_kv_heads (or n_head_kv), and Falcon-7B has one (multi_query).
    Before: both read as one KV head per attention head, 71 and 16 times too many bytes."""
    falcon_7b = {"model_type": "falcon", "hidden_size": 4544, "num_attention_heads": 71, "num_hidden_layers": 32,
                 "multi_query": True, "new_decoder_architecture": False, "torch_dtype": "bfloat16"}  # fmt: skip
    assert kv_bytes_per_token(falcon_7b) == 2 * 32 * 1 * 64 * 2
    falcon_40b = {"model_type": "falcon", "hidden_size": 8192, "num_attention_heads": 128, "num_hidden_layers": 60,
                  "num_kv_heads": 8, "new_decoder_architecture": True, "multi_query": True, "torch_dtype": "bfloat16"}  # fmt: skip
    assert kv_bytes_per_token(falcon_40b) == 2 * 60 * 8 * 64 * 2
    renamed = {k: v for k, v in falcon_40b.items() if k != "num_kv_heads"} | {"n_head_kv": 8}
    assert kv_bytes_per_token(renamed) == 2 * 60 * 8 * 64 * 2


def test_auto_dtype_is_the_model_s_and_a_multimodal_root_dtype_wins():
    """vLLM's cache_dtype "auto" (its /metrics label) is the model's dtype, and vLLM reads a
    multimodal model's dtype from the root config first. Before: "auto" was an unknown dtype, and
    a text_config's float32 under a bfloat16 root doubled the bytes."""
    assert kv_bytes_per_token(LLAMA3_8B, dtype="auto") == 131072
    assert kv_bytes_per_token({**LLAMA3_8B, "torch_dtype": "auto"}) == 131072  # float16, as when missing
    nested = {"model_type": "llava", "torch_dtype": "bfloat16", "text_config": {**LLAMA3_8B, "torch_dtype": "float32"}}
    assert kv_bytes_per_token(nested) == 131072


@pytest.mark.parametrize(
    ("text", "message"),
    [  # before: a JSONDecodeError not naming the file, an AttributeError
        ("{not json", r"config\.json is not JSON: Expecting property name"),
        ("", r"config\.json is not JSON"),
        ("[1, 2]", r"config\.json holds a list, not a JSON object of model settings"),
    ],
)
def test_a_config_file_that_is_no_json_object_is_refused_naming_the_file(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=f"{tmp_path}/{message}"):
        kv_bytes_per_token(tmp_path)


def test_a_text_config_without_the_field_says_where_it_looked():
    """A text_config that leaves out what no class default fills in names where it looked."""
    nested = {"model_type": "llava", "torch_dtype": "float16", "text_config": {"model_type": "phi3", "vocab_size": 32064}}
    with pytest.raises(ValueError, match="model config text_config: num_hidden_layers must be a positive integer, got None"):
        kv_bytes_per_token(nested)


def test_llava_1_5s_text_config_is_read_with_llamas_class_defaults():
    """LLaVA-1.5's text_config leaves Llama's sizes to transformers' defaults (32 layers and
    heads, hidden size 4,096), as vLLM reads it: it was refused."""
    llava = {"model_type": "llava", "torch_dtype": "float16", "text_config": {"model_type": "llama", "vocab_size": 32064}}
    assert kv_bytes_per_token(llava) == 2 * 32 * 32 * 128 * 2 == 524288


@pytest.mark.parametrize(
    ("changes", "per_token"),
    [
        # vLLM serves a float8 checkpoint in 16 bits (no model dtype of its): it was sized at 1 byte.
        ({"torch_dtype": "float8_e4m3fn"}, 131072),
        # A checkpoint declaring an FP8 KV cache (llm-compressor, ModelOpt) is cached in 1 byte.
        ({"quantization_config": {"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8, "type": "float"}}}, 65536),
        ({"quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"}}, 65536),
        ({"quantization_config": {"quant_method": "modelopt", "quantization": {"kv_cache_quant_algo": "fp8"}}}, 65536),
        ({"quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "int4"}}, 131072),  # vLLM's "auto"
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, 131072),  # weights only
    ],
)
def test_the_cache_dtype_is_the_one_vllm_resolves(changes, per_token):
    assert kv_bytes_per_token({**LLAMA3_8B, **changes}) == per_token
    assert kv_bytes_per_token({**LLAMA3_8B, **changes}, dtype="float32") == 262144  # a dtype given wins
    nested = {"model_type": "llava", **{k: v for k, v in changes.items() if k == "quantization_config"}, "text_config": {**LLAMA3_8B, **changes}}
    assert kv_bytes_per_token(nested) == per_token  # the root's quantization, for a nested config


def test_an_fp8_cache_declared_where_vllm_also_looks_is_read(tmp_path):
    """A ModelOpt checkpoint naming its producer but no quant_method, one of ModelOpt 0.29 whose
    quantization is in hf_quant_config.json beside config.json, and llm-compressor's older
    compression_config: vLLM caches each in FP8; they were sized at 2 bytes."""
    modelopt = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}
    assert kv_bytes_per_token({**LLAMA3_8B, "quantization_config": modelopt}) == 65536
    assert kv_bytes_per_token({**LLAMA3_8B, "compression_config": {"kv_cache_scheme": {"num_bits": 8, "type": "float"}}}) == 65536
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(modelopt))
    assert kv_bytes_per_token(tmp_path) == kv_bytes_per_token(tmp_path / "config.json") == 65536


def test_an_nvfp4_cache_is_refused_naming_it():
    config = {**LLAMA3_8B, "quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "NVFP4"}}
    with pytest.raises(ValueError, match="NVFP4 KV cache, which is not modelled"):
        kv_bytes_per_token(config)
    assert kv_bytes_per_token(config, dtype="fp8") == 65536


# The project's tiny model (2 layers, 2 KV heads of 64, float32: 1,024 bytes a token and layer),
# as served with its layers' types changed; vLLM 0.32's CPU build (1 GiB of KV cache, 128-token
# blocks, 2,048 tokens in flight) reported these maximum concurrencies at max_model_len 1,024 and
# 4,096: full attention 512 and 128, one sliding layer of 128 tokens and one full 481.88 and
# 163.84, both sliding 455.11 and 227.56. With random weights for more layers: 3 sliding and 2
# full 157.54 and 60.24 (cached in groups of 2 layers, a padding layer beside the third sliding
# one), 3 sliding and 4 full 120.47 and 40.96 (groups of 4), 4 sliding and 1 full 186.18 and 78.77.
TINY = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 128, "dtype": "float32"}
SLIDING, FULL = "sliding_attention", "full_attention"


@pytest.mark.parametrize(
    ("kv_cache_dtype", "per_token"),
    [(None, 2048), ("auto", 2048), ("bfloat16", 1024), ("float16", 1024), ("fp8", 512), ("fp8_e4m3", 512), ("fp8_e5m2", 512), ("fp8_inc", 512)],
)
def test_the_tiny_models_bytes_a_token_for_each_kv_cache_dtype(tmp_path, kv_cache_dtype, per_token):
    """vLLM's --kv-cache-dtype: "auto" is the config's dtype (float32 here, 4 bytes), each FP8
    one byte. Before: "fp8_inc" (an FP8 cache, float8_e4m3fn in vLLM 0.32) was an unknown dtype."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))  # its "dtype" key, as transformers 5 writes it
    assert kv_bytes_per_token(tmp_path, dtype=kv_cache_dtype) == per_token


@pytest.mark.parametrize(
    ("changes", "concurrency"),
    [
        ({}, (512.0, 128.0)),
        ({"sliding_window": 128, "layer_types": [SLIDING, FULL]}, (481.88, 163.84)),
        ({"sliding_window": 128}, (455.11, 227.56)),
        ({"num_hidden_layers": 5, "sliding_window": 128, "layer_types": [SLIDING, FULL] * 2 + [SLIDING]}, (157.54, 60.24)),
        ({"num_hidden_layers": 7, "sliding_window": 128, "layer_types": [SLIDING, FULL] * 3 + [FULL]}, (120.47, 40.96)),
        ({"num_hidden_layers": 5, "sliding_window": 128, "layer_types": [SLIDING] * 4 + [FULL]}, (186.18, 78.77)),
    ],
)
def test_sliding_window_layers_are_sized_as_vllm_bounds_them(changes, concurrency):
    config = TINY | changes
    sizes = [session_bytes(n, config, block_size=128, in_flight_tokens=2048) for n in (1024, 4096)]
    assert tuple(round((1 << 30) / size, 2) for size in sizes) == concurrency


def test_without_the_tokens_in_flight_a_sliding_layer_is_sized_as_the_whole_context_and_a_block():
    sliding = session_bytes(4096, TINY | {"sliding_window": 128}, block_size=128)
    assert sliding == 2 * (32 + 1) * 128 * 1024 > session_bytes(4096, TINY, block_size=128)


def test_a_sliding_layer_holds_the_window_less_one_token_besides_those_in_flight():
    # min(17 - 1 + 16, 64) = 32 tokens: 2 blocks of 16, and 1 more, in each of the 2 layers
    assert session_bytes(64, TINY | {"sliding_window": 17}, block_size=16, in_flight_tokens=16) == 2 * (2 + 1) * 16 * 1024


@pytest.mark.parametrize(
    ("changes", "windows"),
    [
        ({"sliding_window": 4096}, [4096] * 4),  # Mistral 7B v0.1: every layer
        ({"sliding_window": None}, [None] * 4),
        ({"sliding_window": 0}, [None] * 4),  # vLLM reads 0 as none
        ({"sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 2}, [None] * 4),  # Qwen2
        ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2}, [None, None, 64, 64]),
        ({"sliding_window": 4096, "model_type": "gemma2"}, [4096, None, 4096, None]),
        ({"sliding_window": 512, "sliding_window_pattern": 2}, [512, None, 512, None]),
        ({"sliding_window": 128, "layer_types": [FULL, SLIDING, SLIDING, FULL]}, [None, 128, 128, None]),  # gpt-oss's way
        ({"sliding_window": 128, "layer_types": [FULL] * 4}, [None] * 4),
    ],
)
def test_layer_windows_read_the_config_as_vllm_and_transformers_do(changes, windows):
    assert layer_windows(TINY | {"num_hidden_layers": 4} | changes) == windows


def test_a_gemma3_text_config_slides_five_layers_in_six():
    config = {"text_config": TINY | {"num_hidden_layers": 12, "sliding_window": 1024, "sliding_window_pattern": 6}}
    assert layer_windows(config) == ([1024] * 5 + [None]) * 2


#: google/gemma-3-12b-it's config.json as published, less what does not size the KV cache: its
#: text_config leaves out head_dim (256) and sliding_window_pattern (6), Gemma3TextConfig's
#: defaults, which vLLM reads the config through.
GEMMA3_12B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
    "text_config": {
        "hidden_size": 3840, "model_type": "gemma3_text", "num_attention_heads": 16, "num_hidden_layers": 48,
        "num_key_value_heads": 8, "sliding_window": 1024,
    },
}  # fmt: skip


def test_a_published_gemma3_config_gets_the_class_defaults_it_leaves_out():
    """Read as published, its head_dim was taken from the hidden size (240) and every layer as
    sliding: a session of 32k tokens was sized at 1.1 GB, where vLLM caches 3.2 GB (transformers'
    Gemma3TextConfig gives 48 layers x 8 KV heads x 256, 40 sliding and 8 full)."""
    assert kv_bytes_per_token(GEMMA3_12B) == 2 * 48 * 8 * 256 * 2
    assert layer_windows(GEMMA3_12B) == ([1024] * 5 + [None]) * 8
    # Gemma 3 4B leaves out the head counts as well (8 and 4), and its text_config the model type.
    four_b = {"model_type": "gemma3", "text_config": {"hidden_size": 2560, "num_hidden_layers": 34, "sliding_window": 1024}}
    assert kv_bytes_per_token(four_b) == 2 * 34 * 4 * 256 * 2
    # What a config says wins over the defaults: Gemma 3 27B's head_dim of 128.
    assert kv_bytes_per_token({"model_type": "gemma3_text", "head_dim": 128, "num_attention_heads": 32,
                               "num_key_value_heads": 16, "num_hidden_layers": 62}) == 2 * 62 * 16 * 128 * 2  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sliding_window": -4}, "sliding_window must be a positive integer"),
        ({"sliding_window": "4k"}, "sliding_window must be a positive integer"),
        ({"sliding_window": 128, "layer_types": [SLIDING]}, "layer_types must list one type for each of the 2 layers"),
        ({"sliding_window": 128, "sliding_window_pattern": 0}, "sliding_window_pattern must be a positive integer"),
    ],
)
def test_malformed_window_fields_are_named(changes, message):
    with pytest.raises(ValueError, match=message):
        layer_windows(TINY | changes)
    with pytest.raises(ValueError, match=message):
        session_bytes(1024, TINY | changes)


def test_a_model_mixing_attentions_has_blocks_of_a_cache_group_s_layers():
    """vLLM caches such a model in pages of a group of layers (`_group_size`): in 1 GiB the tiny
    model with one layer of each reported 8,192 blocks of 128 tokens (one layer a page), and with
    3 sliding and 2 full 4,096 (two a page), where blocks x tokens x the model's bytes a token
    would make 2 and 5 GiB. Before, kv_device took that product, or the kv_cache_memory_bytes
    label when there was one."""
    from fleetsched.resources import KVCacheCapacity, kv_device, kv_page_size

    one_of_each = TINY | {"sliding_window": 128, "layer_types": [SLIDING, FULL]}
    capacity = KVCacheCapacity(8192, 128, {})
    assert kv_device("r0", capacity, one_of_each) == {"name": "r0", "memory": 1 << 30}
    assert kv_page_size(capacity, one_of_each) == 128 * 1024
    three_and_two = TINY | {"num_hidden_layers": 5, "sliding_window": 128, "layer_types": [SLIDING, FULL] * 2 + [SLIDING]}
    capacity = KVCacheCapacity(4096, 128, {})
    assert kv_device("r0", capacity, three_and_two)["memory"] == 1 << 30
    assert kv_page_size(capacity, three_and_two) == 2 * 128 * 1024
    every_layer_slides = TINY | {"sliding_window": 128}  # one page a block, as with full attention
    assert kv_device("r0", KVCacheCapacity(4096, 128, {}), every_layer_slides)["memory"] == 1 << 30


# Runs in the vLLM virtualenv: vLLM 0.32's own grouping of random layer mixes (full attention,
# windows of 128 and 512 tokens), as layers cached per attention, padding included.
VLLM_GROUPS = """
import json, random, sys
import torch
from vllm.v1.core.kv_cache_utils import _get_kv_cache_groups_uniform_page_size
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

rng, cases = random.Random(0), []
while len(cases) < 200:
    windows = [rng.choice([None, 128, 512]) for _ in range(rng.randint(2, 40))]
    if len(set(windows)) < 2:
        continue
    kw = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    specs = {f"layers.{i}": FullAttentionSpec(**kw) if w is None else SlidingWindowSpec(sliding_window=w, **kw)
             for i, w in enumerate(windows)}
    groups = _get_kv_cache_groups_uniform_page_size(specs)
    size = max(len(group.layer_names) for group in groups)  # the last group of an attention is padded to it
    cached = {}
    for group in groups:
        window = getattr(group.kv_cache_spec, "sliding_window", None)
        cached[str(window)] = cached.get(str(window), 0) + size
    cases.append({"windows": windows, "cached": cached})
print(json.dumps(cases))
"""


@pytest.mark.vllm
def test_layers_are_grouped_and_padded_as_vllm_groups_them():
    """`_cached_layers` against vLLM's own `_get_kv_cache_groups_uniform_page_size`, on 200
    random mixes of up to three attentions."""
    import os
    import subprocess

    from fleetsched.resources.kv_sizing import _cached_layers
    from fleetsched.testing.fixtures import require_vllm_setup
    from fleetsched.testing.vllm_server import venv_path

    require_vllm_setup()
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH")}
    done = subprocess.run([str(venv_path() / "bin" / "python"), "-c", VLLM_GROUPS], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    cases = json.loads(done.stdout.splitlines()[-1])
    assert len(cases) == 200
    for case in cases:
        ours = {str(window): layers for window, layers in _cached_layers(case["windows"]).items()}
        assert ours == case["cached"], case["windows"]


def test_a_config_file_s_missing_field_is_named_with_the_file(tmp_path):
    """Read from a file, an error names it: "model config: num_hidden_layers ..." named none, and
    a ModelOpt hf_quant_config.json beside it that is no JSON raised a bare JSONDecodeError."""
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4096, "num_attention_heads": 32}))
    with pytest.raises(ValueError, match=f"^{tmp_path}/config.json: num_hidden_layers must be a positive integer, got None$"):
        kv_bytes_per_token(tmp_path)
    with pytest.raises(ValueError, match=f"^{tmp_path}/config.json: num_hidden_layers"):
        session_bytes(4096, tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": {"model_type": "phi3"}}))
    with pytest.raises(ValueError, match=f"^{tmp_path}/config.json text_config: num_hidden_layers"):
        layer_windows(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    (tmp_path / "hf_quant_config.json").write_text("{oops")
    with pytest.raises(ValueError, match=f"^{tmp_path}/hf_quant_config.json is not JSON"):
        kv_bytes_per_token(tmp_path)


#: Published configs (less what does not size the KV cache) that name their sizes as their
#: transformers class's attribute_map does, with the bytes a token vLLM 0.32's ModelConfig
#: gives them (in the dtype it serves them in).
ALIASED = {
    "gpt2": ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12},
             2 * 12 * 12 * 64 * 2),
    "starcoder": (  # multi_query: one KV head
        {"architectures": ["GPTBigCodeForCausalLM"], "model_type": "gpt_bigcode", "n_embd": 6144, "n_head": 48, "n_layer": 40,
         "multi_query": True, "torch_dtype": "bfloat16"}, 2 * 40 * 1 * 128 * 2),
    "gpt-j-6b": ({"architectures": ["GPTJForCausalLM"], "model_type": "gptj", "n_embd": 4096, "n_head": 16, "n_layer": 28,
                  "rotary_dim": 64, "torch_dtype": "float16"}, 2 * 28 * 16 * 256 * 2),
    "bloom-560m": ({"architectures": ["BloomForCausalLM"], "model_type": "bloom", "hidden_size": 1024, "n_head": 16, "n_layer": 24,
                    "torch_dtype": "float16"}, 2 * 24 * 16 * 64 * 2),
    "falcon-7b (older config)": ({"architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 4544, "n_head": 71,
                                 "n_layer": 32, "multi_query": True, "torch_dtype": "bfloat16"}, 2 * 32 * 1 * 64 * 2),
    "chatglm3-6b": ({"architectures": ["ChatGLMModel"], "model_type": "chatglm", "hidden_size": 4096, "num_attention_heads": 32,
                     "num_layers": 28, "multi_query_attention": True, "multi_query_group_num": 2, "kv_channels": 128,
                     "torch_dtype": "float16"}, 2 * 28 * 2 * 128 * 2),
    "dbrx": ({"architectures": ["DbrxForCausalLM"], "model_type": "dbrx", "d_model": 6144, "n_heads": 48, "n_layers": 40,
              "attn_config": {"kv_n_heads": 8}, "torch_dtype": "bfloat16"}, 2 * 40 * 8 * 128 * 2),
}  # fmt: skip


@pytest.mark.parametrize("name", list(ALIASED))
def test_configs_naming_their_sizes_otherwise_are_read_as_vllm_reads_them(name):
    """GPT-2's n_layer, ChatGLM's num_layers, DBRX's n_layers and attn_config.kv_n_heads...:
    each was refused for lacking num_hidden_layers (DBRX would then have had 6 times its KV
    heads), where vLLM serves them."""
    config, per_token = ALIASED[name]
    assert kv_bytes_per_token(config) == per_token


@pytest.mark.parametrize(
    ("config", "message"),
    [  # before: sized as if every layer cached K and V, and held no state beside
        ({"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048, "head_dim": 256,
          "num_attention_heads": 16, "num_key_value_heads": 2, "num_hidden_layers": 48, "full_attention_interval": 4},
         "Qwen3NextForCausalLM has layers that hold a state"),
        ({"architectures": ["JambaForCausalLM"], "model_type": "jamba", "hidden_size": 4096, "num_attention_heads": 32,
          "num_key_value_heads": 8, "num_hidden_layers": 32, "attn_layer_offset": 4, "attn_layer_period": 8},
         "JambaForCausalLM has layers that hold a state"),
        ({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
          "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
                          "head_dim": 256, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}},
         "Qwen3_5ForConditionalGeneration has layers that hold a state"),
        # Gemma 4: full-attention layers of head_dim 512, one in six, neither in its config.json
        ({"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "hidden_size": 2304, "num_hidden_layers": 30,
          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 512},
         "the layers of model_type 'gemma4_text' differ in head_dim, which is not modelled"),
        ({"model_type": "gemma4", "text_config": {"num_hidden_layers": 30, "sliding_window": 1024}},
         "model_type 'gemma4' differ in head_dim"),
    ],
)  # fmt: skip
def test_models_whose_layers_are_not_all_alike_attention_are_refused_by_name(config, message):
    for size in (kv_bytes_per_token, layer_windows, lambda c: session_bytes(4096, c)):
        with pytest.raises(ValueError, match=message):
            size(config)


# Runs in the vLLM virtualenv: vLLM 0.32's bytes a token for each config directory given, from
# its ModelConfig (the heads, head size and layers it caches, in the dtype it serves them in).
VLLM_BYTES = """
import json, sys
from vllm.config import ModelConfig, ParallelConfig
from vllm.utils.torch_utils import get_dtype_size

sizes = {}
for path in sys.argv[2:]:
    model = ModelConfig(model=path, tokenizer=sys.argv[1], skip_tokenizer_init=True)
    parallel = ParallelConfig()
    per_layer = model.get_num_kv_heads(parallel) * model.get_head_size() * (1 if model.use_mla else 2)
    sizes[path] = model.get_num_layers(parallel) * per_layer * get_dtype_size(model.dtype)
print(json.dumps(sizes))
"""


@pytest.mark.vllm
def test_bytes_a_token_are_those_vllm_reads_from_the_config(tmp_path):
    """`ALIASED`'s figures, GQA, MHA, an explicit head_dim (Qwen3's, and Mistral NeMo's of 128
    where its hidden size makes 160) and MLA against vLLM's own reading of each config.json (its
    multimodal models are not inspected without torchvision)."""
    import os
    import subprocess

    from fleetsched.testing.fixtures import require_vllm_setup
    from fleetsched.testing.vllm_server import model_path, venv_path

    require_vllm_setup()
    configs = {name: config for name, (config, _) in ALIASED.items()} | {
        "llama3-8b": LLAMA3_8B | {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
        "llama-mha": {k: v for k, v in LLAMA3_8B.items() if k != "num_key_value_heads"}
        | {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
        "qwen3": LLAMA3_8B | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "head_dim": 128},
        "deepseek-v3": DEEPSEEK_V3 | {"architectures": ["DeepseekV3ForCausalLM"]},
        "mistral-nemo": LLAMA3_8B | {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 5120, "head_dim": 128,
                         "num_hidden_layers": 40, "sliding_window": None},
    }  # fmt: skip
    for name, config in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH")} | {"HF_HUB_OFFLINE": "1"}
    args = [str(venv_path() / "bin" / "python"), "-c", VLLM_BYTES, str(model_path()), *(str(tmp_path / name) for name in configs)]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.splitlines()[-1])
    for name in configs:
        # vLLM serves a float32 (or dtype-less) config in 16 bits under its --dtype auto
        assert kv_bytes_per_token(tmp_path / name, dtype="bfloat16") == theirs[str(tmp_path / name)], name
