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
        assert spec.experts == 8 and spec.experts_per_token == 2 and spec.hidden == 256
        # the shared weights plus k routed experts per layer are the active parameters
        assert spec.shared_params + spec.layers * 2 * spec.expert_params == pytest.approx(
            spec.params_active)
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


def test_moe_decode_reads_the_shared_weights_once_and_the_experts_its_batch_touches():
    m = PRESETS["moe-235b-a22b"]
    dm = DeviceModel(m, H800, 8)
    # one token reads the shared weights and its k experts: the active parameters less the input
    # embedding table, of which it reads a row
    assert m.shared_params > 0.03 * m.params_total
    assert dm.expected_experts(1) == pytest.approx(m.experts_per_token)
    assert dm.weights_read(1) == pytest.approx((m.params_active - m.lookup_params)
                                               * m.bytes_per_param)
    assert dm.weights_read(1) > m.shared_params * m.bytes_per_param
    reads = [dm.weights_read(b) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert all(a < b for a, b in zip(reads, reads[1:], strict=False))  # more tokens, more experts
    # ... sublinearly: the shared weights are read once and experts are shared between tokens
    assert all(b < 2 * a for a, b in zip(reads, reads[1:], strict=False))
    assert reads[3] < 8 * reads[0] - 7 * m.shared_params * m.bytes_per_param
    assert reads[-1] == pytest.approx(m.weight_bytes, rel=0.01)  # a big batch touches them all
    # a small batch's decode step reads far fewer bytes than the whole model
    flops, nbytes = dm.decode_work(1, 1024)
    assert nbytes < m.weight_bytes / 5
    d8 = PRESETS["dense-8b"]
    dense = DeviceModel(d8, H800, 8)
    assert dense.weights_read(1) == dense.weights_read(64) == pytest.approx(
        d8.weight_bytes - d8.hidden * d8.vocab * d8.bytes_per_param)


def test_batch_one_decode_pays_a_real_engines_floor():
    """One sequence at 10k context: a few ms per token for an 8B model on 8 x H800, tens of ms
    for the 235B MoE, most of it the step floor and the collectives, not the bytes."""
    dense = DeviceModel(PRESETS["dense-8b"], H800, 8)
    moe = DeviceModel(PRESETS["moe-235b-a22b"], H800, 8)
    t_dense, t_moe = dense.decode_step_time([10_000]), moe.decode_step_time([10_000])
    assert 2e-3 < t_dense < 6e-3
    assert 10e-3 <= t_moe < 50e-3
    for dm, t in ((dense, t_dense), (moe, t_moe)):
        roofline = dm._roofline(*dm.decode_work(1, 10_000))
        assert t > 2.5 * roofline
        assert t == pytest.approx(dm.step_floor + dm.comm_time(1) + roofline)
    # a big batch amortises the floor: per sequence, 64 cost far less than 64 alone
    assert dense.decode_step_time([10_000] * 64) < 10 * t_dense


@pytest.mark.parametrize("config,fp8_gpus,context,published_s", [
    # Llama-3.1-8B-Instruct, concurrency 1, H100: 4.37-4.63 ms inter-token latency
    (dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
          intermediate_size=14336), 1, 1000, 4.5e-3),
    # Llama-3.3-70B-Instruct FP8 TP2 on 2 x H100, 5,000 input tokens: 18.58 ms
    (dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
          intermediate_size=28672), 2, 5250, 18.58e-3),
])
def test_the_floor_gives_nvidias_published_concurrency_one_latencies(config, fp8_gpus, context,
                                                                     published_s):
    """NVIDIA NIM's LLM benchmarking page (the sources in resources/catalog.py)."""
    spec = ModelSpec.from_hf_config(dict(config, model_type="llama", vocab_size=128256),
                                    bytes_per_param=1)
    dm = DeviceModel(spec, CATALOG["H100"], fp8_gpus)
    assert dm.decode_step_time([context]) == pytest.approx(published_s, rel=0.12)


def test_tensor_and_expert_parallel_engines_pay_collectives():
    dense8, dense1 = (DeviceModel(PRESETS["dense-8b"], H800, g) for g in (8, 1))
    assert dense1.comm_time(64) == 0.0
    layers = PRESETS["dense-8b"].layers
    # two all-reduces per layer, each at least the link's latency; more tokens, more bytes
    assert dense8.comm_time(1) == pytest.approx(2 * layers * H800.nvlink_latency_s, rel=0.01)
    assert dense8.comm_time(8192) > 20 * dense8.comm_time(1)
    assert dense8.prefill_time(8192) > dense1.prefill_time(8192) / 8 + dense8.comm_time(8192) / 2
    # a MoE layer: the attention's all-reduce plus the experts' dispatch and combine
    moe = DeviceModel(PRESETS["moe-235b-a22b"], H800, 8)
    assert moe.comm_time(1) == pytest.approx(3 * PRESETS["moe-235b-a22b"].layers
                                             * H800.nvlink_latency_s, rel=0.01)
    # past one node the collectives go over the NICs
    dense16 = DeviceModel(PRESETS["dense-8b"], H800, 16)
    assert dense16.comm_time(1) == pytest.approx(2 * layers * H800.network_latency_s, rel=0.01)


def test_kv_transfer_runs_at_the_narrower_ends_bandwidth():
    m = PRESETS["dense-8b"]
    wide, narrow = DeviceModel(m, H800, 8), DeviceModel(m, H20, 1)
    tokens = 100_000
    alone = narrow.kv_transfer_time(tokens)
    assert wide.kv_transfer_time(tokens, peer=narrow) == pytest.approx(alone)
    assert narrow.kv_transfer_time(tokens, peer=wide) == pytest.approx(alone)  # either side
    assert wide.kv_transfer_time(tokens, peer=1) == pytest.approx(alone)  # a device count
    assert wide.kv_transfer_time(tokens, peer=wide.link()) == pytest.approx(
        wide.kv_transfer_time(tokens))
    assert wide.kv_transfer_time(tokens) < alone / 7
    assert narrow.kv_transfer_time(0, peer=wide) == 0.0


def test_a_train_step_grows_with_ppo_epochs_and_minibatches():
    dm = DeviceModel(PRESETS["dense-8b"], H800, 8)
    batch = [4096] * 64
    one = dm.train_step_time(batch)
    two = dm.train_step_time(batch, ppo_epochs=2)
    four = dm.train_step_time(batch, ppo_epochs=4)
    # each epoch adds a forward and backward; one minibatch needs no proximal pass of its own
    # (its first forward pass has the step's starting weights)
    assert one < two < four
    assert (four - two) == pytest.approx(2 * (two - one), rel=1e-6)
    assert two / one == pytest.approx(2, rel=0.05)
    # every minibatch adds an optimizer step over all the parameters, and those after the first
    # their share of a proximal forward without gradient (a third of a forward and backward)
    kernel = dm.step_floor - H800.step_floor_s
    more = dm.train_step_time(batch, minibatches=4)
    passes = (one - dm.optimizer_step_time() - 2 * kernel) / 3
    assert more - one == pytest.approx(3 * (dm.optimizer_step_time() + 2 * kernel)
                                       + 0.75 * passes + kernel)
    assert dm.optimizer_step_time() > PRESETS["dense-8b"].params_total * 28 / (
        8 * H800.mem_bandwidth)
    with pytest.raises(ValueError):
        dm.train_step_time(batch, ppo_epochs=0)


def test_the_head_costs_flops_only_where_logits_are_taken_and_the_table_none():
    m = PRESETS["dense-8b"]  # untied: a 128256 x 4096 input table and head
    dm = DeviceModel(m, H800, 8)
    head = m.vocab * m.hidden
    assert m.lookup_params == m.head_params == head
    assert m.body_params == pytest.approx(m.params_active - 2 * head)
    attention = m.attention_flops
    # a prefill chunk takes logits at its last token (the engine samples there) ...
    flops, _ = dm.prefill_work(4096, 1024)
    assert flops == pytest.approx(2 * (m.body_params * 4096 + head) + attention(4096, 3072))
    # ... a decode step at every sequence's token
    flops, nbytes = dm.decode_work(16, 16 * 2048)
    assert flops == pytest.approx(2 * (m.body_params + head) * 16 + attention(1, 16 * 2048))
    # the table is read a row per token: the weights a step reads leave it out, the head in
    assert nbytes == pytest.approx((m.params_total - head) * 2 + m.kv_bytes_per_token * 16 * 2048)
    # a train step's head runs at the loss's positions only
    full, short = dm.train_step_time([4096] * 8), dm.train_step_time([4096] * 8, loss_tokens=512)
    compute = (full - short) * H800.peak_flops * 8 * dm.mfu
    assert compute == pytest.approx(3 * 2 * head * (8 * 4096 - 512))
    # a tied head is the table: every active parameter but it multiplies each token
    tied = ModelSpec.from_hf_config({
        "model_type": "tied", "hidden_size": 1024, "num_hidden_layers": 4,
        "num_attention_heads": 8, "intermediate_size": 4096, "vocab_size": 32000,
        "tie_word_embeddings": True})
    assert tied.lookup_params == 0 and tied.body_params == tied.params_active - 32000 * 1024
    assert DeviceModel(tied, H800).weights_read(1) == tied.weight_bytes


def test_training_and_transfers_scale_with_devices_and_bytes():
    dm, dm8 = DeviceModel(PRESETS["dense-8b"], H800), DeviceModel(PRESETS["dense-8b"], H800, 8)
    assert dm.train_step_time(65536) == pytest.approx(8 * dm8.train_step_time(65536), rel=0.01)
    # attention is within each sequence: 16 sequences of 4k cost less than one of 64k
    assert dm.train_step_time([4096] * 16) < dm.train_step_time(65536)
    latency = H800.network_latency_s
    assert dm.kv_transfer_time(4096) - latency == pytest.approx(
        2 * (dm.kv_transfer_time(2048) - latency))
    assert dm.kv_transfer_time(2048, within_node=True) < dm.kv_transfer_time(2048)
    assert dm.weight_broadcast_time() == pytest.approx(
        latency + PRESETS["dense-8b"].weight_bytes / H800.network_bandwidth)


def test_the_router_uses_the_device_model_for_a_named_model():
    pools = [PoolSpec(name="a", profile="H800", role=Role.INFERENCE),
             PoolSpec(name="b", profile="H20", role=Role.INFERENCE)]
    for model in ("dense-8b", "moe-30b-a3b"):
        assert route(pools, Workload(model=model)) == {Stage.PREFILL: "a", Stage.DECODE: "b"}
    with pytest.raises(ValueError, match="unknown model"):
        Workload(model="no-such-model")
