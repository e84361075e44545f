"""Roofline prior: KV arithmetic from a model's shape and a GPU."""
import pytest

from calibrate.prior import GPUS, MODELS, GiB, kv_cache, prior_profile
from sim.profile import from_dict, load_profile


def test_llama3_8b_kv_bytes_per_token_and_block():
    m = MODELS["llama-3.1-8b"]
    assert m.kv_bytes_per_token == 2 * 8 * 128 * 2 * 32 == 131_072
    kv = kv_cache(m, GPUS["h100"], 0.9, 16)
    assert kv["bytes_per_block"] == 2 * 1024 * 1024          # 2 MiB per 16-token block


def test_kv_blocks_follow_memory_minus_weights_and_reserve():
    m, g = MODELS["qwen2.5-7b"], GPUS["h100"]
    kv = kv_cache(m, g, 0.9, 16, reserve_bytes=2 * GiB)
    expect = int((g.memory_bytes * 0.9 - m.params * 2 - 2 * GiB) // (57_344 * 16))
    assert kv["num_gpu_blocks"] == expect
    assert kv_cache(m, g, 0.5, 16)["num_gpu_blocks"] < kv["num_gpu_blocks"]


def test_model_too_big_for_gpu_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        kv_cache(MODELS["qwen3-14b"], GPUS["h100"], 0.3, 16)


def test_prior_is_a_valid_profile():
    p = from_dict(prior_profile("qwen2.5-7b", capacity=2.0))
    assert p.engine["block_size"] == 16 and p.step_time.per_token_s > 0


@pytest.mark.parametrize("name,capacity", [("qwen2.5-7b", 2.78), ("qwen3-14b", 1.09), ("llama-3.1-8b", 1.83)])
def test_embedded_profiles_say_how_they_were_obtained(name, capacity):
    p = load_profile(name)
    assert p.provenance["kind"] == "fitted to published figures"
    assert p.provenance["published"]["capacity"] == capacity
    assert abs(p.capacity / capacity - 1) < 0.03
