"""The device model: parameter and KV accounting of real configs, roofline regimes, memory limits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from resources.affinity import Workload, route
from resources.catalog import CATALOG, HardwareProfile
from resources.device_model import PRESETS, DeviceModel, ModelSpec, model_spec
from resources.pools import PoolSpec, Role, Stage

H800, H20 = CATALOG["H800"], CATALOG["H20"]


@pytest.mark.parametrize("name,total,active", [
    ("dense-8b", 8.03e9, 8.03e9),  # Llama-3.1-8B
    ("dense-32b", 32.5e9, 32.5e9),  # Qwen2.5-32B (its card: 32.5B)
    ("moe-30b-a3b", 30.5e9, 3.3e9),  # Qwen3-30B-A3B (its card: 30.5B total, 3.3B activated)
])
def test_presets_count_the_published_parameters(name, total, active):
    m = PRESETS[name]
    assert m.params_total == pytest.approx(total, rel=0.02)
    assert m.params_active == pytest.approx(active, rel=0.03)


@pytest.mark.parametrize("model_type,extra", [
    ("qwen2", {}),
    ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
                   "head_dim": 32}),
])
def test_a_saved_config_gives_the_real_models_parameters_and_kv_size(tmp_path, model_type,
                                                                     extra):
    cfg = AutoConfig.for_model(model_type, vocab_size=1000, hidden_size=256,
                               intermediate_size=512, num_hidden_layers=3,
                               num_attention_heads=8, num_key_value_heads=2,
                               tie_word_embeddings=False, **extra)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path)
    spec = model_spec(str(tmp_path))
    real = sum(p.numel() for p in model.parameters())
    assert spec.params_total == pytest.approx(real, rel=0.01)
    if "num_experts" in extra:
        assert spec.params_active < spec.params_total
    # the KV bytes of one token are what the model's cache actually holds, at 2 bytes a value
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]), use_cache=True)
    cached = sum(layer.keys[0, :, :1].numel() + layer.values[0, :, :1].numel()
                 for layer in out.past_key_values.layers)
    assert spec.kv_bytes_per_token == cached * 2


def test_prefill_is_compute_bound_and_decode_bandwidth_bound():
    m = PRESETS["dense-8b"]
    h800, h20 = DeviceModel(m, H800), DeviceModel(m, H20)
    # a long prefill runs at the FLOP/s ratio; a decode step at the bandwidth ratio
    assert h20.prefill_time(8192) / h800.prefill_time(8192) == pytest.approx(
        H800.peak_flops / H20.peak_flops, rel=0.05)
    assert h800.decode_step_time([4096] * 64) / h20.decode_step_time([4096] * 64) == \
        pytest.approx(H20.mem_bandwidth / H800.mem_bandwidth, rel=0.05)
    # per dollar: H800 wins prefill, H20 wins decode
    assert h800.prefill_time(2048) * H800.price_per_hour < h20.prefill_time(2048) * \
        H20.price_per_hour
    assert h20.decode_step_time([4096] * 64) * H20.price_per_hour < \
        h800.decode_step_time([4096] * 64) * H800.price_per_hour
    # cached tokens cost attention and KV reads, not weight FLOPs again
    assert h800.prefill_time(512, cached=8192) < h800.prefill_time(512 + 8192)
    assert h800.prefill_time(512, cached=8192) > h800.prefill_time(512)


def test_weights_come_first_and_kv_memory_caps_the_batch():
    m = PRESETS["dense-32b"]
    one = DeviceModel(m, H800)  # 65.5 GB of weights on an 80 GB device
    assert 0 < one.kv_capacity_tokens < 30_000
    n = one.kv_capacity_tokens // 4096
    assert one.fits([4096] * n) and not one.fits([4096] * (n + 1))
    two = DeviceModel(m, H800, gpus=2)  # sharded over two devices: far more room for KV
    assert two.kv_capacity_tokens > 5 * one.kv_capacity_tokens
    small = HardwareProfile(name="small", peak_flops=1e14, mem_bandwidth=1e12,
                            memory_bytes=40e9, price_per_hour=1.0)
    assert DeviceModel(m, small).kv_capacity_tokens == 0 and not DeviceModel(m, small).fits([1])


def test_a_mixed_step_reads_the_weights_once():
    dm = DeviceModel(PRESETS["dense-8b"], H800)
    prefill, decode = dm.prefill_time(256, 1024), dm.decode_step_time([2048] * 32)
    mixed = dm.mixed_step_time([(256, 1024)], [2048] * 32)
    assert max(prefill, decode) <= mixed < prefill + decode
    assert dm.mixed_step_time([], [2048] * 32) == pytest.approx(decode)


def test_moe_decode_reads_only_the_experts_a_small_batch_touches():
    m = PRESETS["moe-30b-a3b"]
    dense_like = ModelSpec(name="d", params_total=m.params_total, params_active=m.params_total,
                           kv_bytes_per_token=m.kv_bytes_per_token)
    assert DeviceModel(m, H20).decode_step_time([1024]) < \
        DeviceModel(dense_like, H20).decode_step_time([1024]) / 5


def test_training_and_transfers_scale_with_devices_and_bytes():
    dm, dm8 = DeviceModel(PRESETS["dense-8b"], H800), DeviceModel(PRESETS["dense-8b"], H800, 8)
    assert dm.train_step_time(65536) == pytest.approx(8 * dm8.train_step_time(65536))
    # attention is within each sequence: 16 sequences of 4k cost less than one of 64k
    assert dm.train_step_time([4096] * 16) < dm.train_step_time(65536)
    assert dm.kv_transfer_time(4096) == pytest.approx(2 * dm.kv_transfer_time(2048))
    assert dm.kv_transfer_time(2048, within_node=True) < dm.kv_transfer_time(2048)
    assert dm.weight_broadcast_time() == pytest.approx(
        PRESETS["dense-8b"].weight_bytes / H800.network_bandwidth)


def test_the_router_uses_the_device_model_for_a_named_model():
    pools = [PoolSpec(name="a", profile="H800", role=Role.INFERENCE),
             PoolSpec(name="b", profile="H20", role=Role.INFERENCE)]
    for model in ("dense-8b", "moe-30b-a3b"):
        assert route(pools, Workload(model=model)) == {Stage.PREFILL: "a", Stage.DECODE: "b"}
    with pytest.raises(ValueError, match="unknown model"):
        Workload(model="no-such-model")
