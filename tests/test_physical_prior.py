"""The physical step-time model (calibrate.prior, calibrate.model_shape,
calibrate.gpus): shapes from published config.json files, tensor
parallelism, mixtures of experts, FP8, CPU offload, the GPU catalogue, and
the one-line refusals of what vLLM would refuse."""
import copy
import json
import os
import subprocess
import sys

import pytest

from calibrate.gpus import CATALOGUE, gpu, gpu_key
from calibrate.model_shape import MODELS, name_of_config, shape_from_config
from calibrate.prior import ALLREDUCE_BULK_EFF, PCIE_ALLREDUCE_EFF, GiB, Serving, kv_cache, prior_profile, step_time
from llmsim.cli import main as cli_main
from sim.engine.step_time import MoEStepTimeModel, graph_tokens, step_time_model
from sim.profile import ProfileError, from_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "calibrate", "data", "peer-h100", "model_configs")

# mistralai/Mixtral-8x7B-Instruct-v0.1 config.json (the keys the shape reads)
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def config(name: str) -> dict:
    with open(os.path.join(CONFIGS, name, "config.json")) as f:
        return json.load(f)


def test_the_three_embedded_gpu_keys_keep_their_figures():
    assert (CATALOGUE["h100"].peak_flops, CATALOGUE["h100"].bandwidth) == (989.4e12, 3.35e12)
    assert (CATALOGUE["h200"].bandwidth, CATALOGUE["a100"].peak_flops) == (4.8e12, 312e12)
    assert CATALOGUE["h100"].name == "NVIDIA H100 80GB HBM3 (SXM)"


def test_catalogue_figures_are_sane_and_sourced():
    for key, g in CATALOGUE.items():
        assert g.source and g.link and g.link_bandwidth > 0 and g.host_bandwidth > 0, key
        assert g.fp8_flops is None or abs(g.fp8_flops / g.peak_flops - 2) < 0.05, key
        assert 10 * GiB < g.memory_bytes < 200 * GiB, key
    assert {k for k, g in CATALOGUE.items() if g.fp8_flops is None} == {"a100", "a100-40gb", "a100-pcie"}
    for k in ("h100", "h100-pcie", "h200", "a100", "a100-40gb", "l40s", "l4", "b200"):
        assert k in CATALOGUE


def test_reported_gpu_names_map_to_keys_and_unknown_ones_list_the_catalogue():
    assert gpu_key("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_key("H100 80GB HBM3") == "h100"
    assert gpu_key("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert gpu("NVIDIA L40S") is CATALOGUE["l40s"]
    # a load test's labels: a key in other case, dashes for spaces (the BLIS campaign's H100, A100-80GB, L40S)
    assert [gpu_key(n) for n in ("H100", "A100-80GB", "L40S", "A100-40GB", "H100-SXM", "nvidia a100 80gb pcie")] == [
        "h100", "a100", "l40s", "a100-40gb", "h100", "a100-pcie"]
    with pytest.raises(ValueError, match="h100, h100-pcie"):
        gpu("GeForce RTX 4090")
    with pytest.raises(ValueError, match="unknown GPU 'H100 NVL'"):
        gpu("H100 NVL")


@pytest.mark.parametrize("folder,params", [("llama-3.1-8b-instruct", 8_030_261_248),
                                           ("qwen2.5-7b-instruct", 7_615_616_512),
                                           ("llama-3.1-70b-instruct", 70_553_706_496)])
def test_dense_parameter_counts_match_the_published_checkpoints(folder, params):
    assert shape_from_config(config(folder)).params == params


def test_embedded_shapes_agree_with_their_configs():
    assert shape_from_config(config("llama-3.1-8b-instruct")).groups == MODELS["llama-3.1-8b"].groups


def test_mixtral_total_and_active_parameters():
    s = shape_from_config(MIXTRAL)
    assert (s.experts, s.experts_per_token, s.moe_layers) == (8, 2, 32)
    assert abs(s.params / 46.7e9 - 1) < 0.01                   # Mixtral 8x7B: 46.7B parameters
    assert abs((s.active_params + s.embedding_params) / 12.9e9 - 1) < 0.01     # 12.9B active


def test_llama4_scout_nested_multimodal_fp8_config():
    s = shape_from_config(config("llama-4-scout-17b-16e-instruct-fp8-dynamic"))
    assert (s.layers, s.hidden, s.experts, s.experts_per_token, s.moe_layers) == (48, 5120, 16, 1, 48)
    assert s.shared_intermediate == 8192 and s.vision_params > 0
    assert abs(s.params / 109e9 - 1) < 0.02                     # 109B total
    assert abs((s.active_params + s.embedding_params) / 17e9 - 1) < 0.03     # 17B active
    # the ignore list keeps attention, the routers, the LM head and the vision tower in 16 bits
    assert s.quantization == "fp8"
    assert set(s.unquantized) >= {"attention", "router", "lm_head", "vision", "embed"}
    assert s.quantized("experts") and s.quantized("shared")
    assert 100e9 < s.weight_bytes < 130e9                        # the checkpoint: about 110 GB


def test_fp8_of_a_dense_checkpoint_halves_its_matrix_weights():
    bf16 = shape_from_config(config("llama-3.1-8b-instruct"))
    fp8 = shape_from_config(config("llama-3.1-8b-instruct"), quantization="fp8")
    assert fp8.group_bytes("mlp") * 2 == bf16.group_bytes("mlp")
    assert fp8.group_bytes("lm_head") == bf16.group_bytes("lm_head")
    on_h100 = step_time(fp8, CATALOGUE["h100"], 0.6, 0.8)
    on_a100 = step_time(fp8, CATALOGUE["a100"], 0.6, 0.8)
    base = step_time(bf16, CATALOGUE["h100"], 0.6, 0.8)
    assert on_h100["per_token_s"] < 0.6 * base["per_token_s"]   # FP8 peak
    assert on_h100["fixed_s"] < base["fixed_s"]                 # fewer bytes to read
    assert abs(on_a100["per_token_s"] * 312e12 / (base["per_token_s"] * 989.4e12) - 1) < 1e-9   # weight-only


def test_tensor_parallelism_splits_weights_kv_and_flops_and_adds_allreduces():
    s = shape_from_config(config("llama-3.1-70b-instruct"))
    h100 = CATALOGUE["h100"]
    four = step_time(s, h100, 0.6, 0.8, form="roofline", serving=Serving(tensor_parallel_size=4))
    eight = step_time(s, h100, 0.6, 0.8, form="roofline", serving=Serving(tensor_parallel_size=8))
    assert abs(four["weights_s"] / eight["weights_s"] - 2) < 1e-9
    assert abs(four["per_decode_ctx_s"] / eight["per_decode_ctx_s"] - 2) < 1e-9
    assert eight["fixed_s"] == four["fixed_s"]                  # 2 all-reduces a layer, at any TP
    assert four["fixed_s"] - 0.002 == pytest.approx(2 * 80 * h100.allreduce_latency_s, rel=1e-9)
    # the all-reduces' bytes a token: their own term, added to the step (not under the weights' read)
    ring = 2 * 80 * 2 * 3 / 4 * 8192 * 2 / (h100.link_bandwidth * 0.7)
    assert four["comm_per_token_s"] == pytest.approx(ring, rel=1e-9)
    one = step_time(s, h100, 0.6, 0.8, form="roofline")
    assert "comm_per_token_s" not in one and four["per_token_s"] == pytest.approx(one["per_token_s"] / 4)
    linear = step_time(s, h100, 0.6, 0.8, serving=Serving(tensor_parallel_size=4))
    assert linear["per_token_s"] == pytest.approx(four["per_token_s"] + ring, rel=1e-9)
    # past 8 MiB a message (512 tokens of 8,192 x 2 bytes) NCCL's bulk rate: a 8,192-token chunk's
    # all-reduces cost the first 512 tokens at allreduce_eff, the rest at ALLREDUCE_BULK_EFF
    bulk = ring * 0.7 / ALLREDUCE_BULK_EFF
    st = step_time_model(four)
    assert st.comm_s(64) == pytest.approx(64 * ring, rel=1e-9)
    assert st.comm_s(8192) == pytest.approx(512 * ring + (8192 - 512) * bulk, rel=1e-9)
    assert "comm_bulk_per_token_s" not in step_time(s, h100, 0.6, 0.8, form="roofline", allreduce_eff=0.9,
                                                    serving=Serving(tensor_parallel_size=4))
    kv = kv_cache(s, h100, 0.9, 16, serving=Serving(tensor_parallel_size=4))
    assert kv["kv_bytes_per_token"] == 2 * 80 * 2 * 128 * 2     # 8 KV heads on 4 GPUs: 2 each
    assert abs(kv["weights_bytes"] / s.weight_bytes - 0.25) < 1e-6


def test_allreduces_over_pcie_move_at_the_links_rate_not_the_fitted_nvlink_fraction():
    s = shape_from_config(config("llama-3.1-8b-instruct"))
    l40s, two = CATALOGUE["l40s"], Serving(tensor_parallel_size=2)
    assert l40s.link.startswith("PCIe") and CATALOGUE["h100"].link.startswith("NVLink")
    a, b = (step_time(s, l40s, 0.6, 0.8, form="roofline", allreduce_eff=x, serving=two) for x in (0.1, 0.9))
    ring = 2 * 32 * 2 * 1 / 2 * 4096 * 2        # bytes a token moves: 2 all-reduces a layer, ring share 1/2
    assert a["comm_per_token_s"] == b["comm_per_token_s"] == pytest.approx(
        ring / (l40s.link_bandwidth * PCIE_ALLREDUCE_EFF), rel=1e-9)
    assert a["fixed_s"] - 0.002 == pytest.approx(2 * 32 * l40s.allreduce_latency_s, rel=1e-9)
    h100 = [step_time(s, CATALOGUE["h100"], 0.6, 0.8, form="roofline", allreduce_eff=x, serving=two)
            for x in (0.1, 0.9)]
    assert h100[0]["comm_per_token_s"] == pytest.approx(9 * h100[1]["comm_per_token_s"], rel=1e-9)


def test_a_moe_block_costs_its_fixed_time_every_step_and_a_dense_layer_nothing():
    h100 = CATALOGUE["h100"]
    dense = shape_from_config(config("llama-3.1-8b-instruct"))
    base, more = (step_time(dense, h100, 0.6, 0.8, form="roofline", moe_layer_overhead_s=x) for x in (0.0, 6e-5))
    assert more == base
    scout = shape_from_config(config("llama-4-scout-17b-16e-instruct-fp8-dynamic"))
    assert (scout.layers, scout.moe_layers) == (48, 48)
    base, more = (step_time(scout, h100, 0.6, 0.8, form="moe", moe_layer_overhead_s=x,
                            serving=Serving(tensor_parallel_size=2)) for x in (0.0, 6e-5))
    assert more["fixed_s"] - base["fixed_s"] == pytest.approx(48 * 6e-5, rel=1e-9)
    assert {k: v for k, v in more.items() if k != "fixed_s"} == {k: v for k, v in base.items() if k != "fixed_s"}


def test_a_moe_prefill_pays_its_dense_layers_compute_while_its_experts_ride_on_their_read():
    h100, scout = CATALOGUE["h100"], shape_from_config(config("llama-4-scout-17b-16e-instruct-fp8-dynamic"))
    st = step_time_model(step_time(scout, h100, 0.6, 0.8, form="moe", serving=Serving(tensor_parallel_size=2)))
    # the routed experts' compute: k of E experts a MoE layer, FP8, split two ways; the dense layers' the rest
    routed = 48 * 1 * 3 * 5120 * 8192
    assert scout.routed_params == routed
    assert st.expert_per_token_s == pytest.approx(2 * routed / 2 / (h100.fp8_flops * 0.6), rel=1e-9)
    assert st.per_token_s > st.expert_per_token_s > 0
    n = 1024            # a prefill chunk: the dense layers compute-bound, the experts (64 tokens each) memory-bound
    assert st.per_token_s * n > st.weights_s and st.expert_per_token_s * n < st.experts_read_s(n)
    assert st.matmul_s(n) == pytest.approx(st.per_token_s * n + st.expert_weights_s, rel=1e-9)
    # one kernel bound by the larger of the sums would hide the dense compute under the experts' read
    read = st.weights_s + st.experts_read_s(n)
    assert st.matmul_s(n) > max((st.per_token_s + st.expert_per_token_s) * n, read) + 5e-3
    # a lone decode: reads only
    assert st.matmul_s(1) == pytest.approx(st.weights_s + st.experts_read_s(1), rel=1e-12)


def test_a_vision_tower_or_experts_say_where_the_servers_kv_count_goes():
    scout = shape_from_config(config("llama-4-scout-17b-16e-instruct-fp8-dynamic"))
    kv = prior_profile(scout, "h100", serving=Serving(tensor_parallel_size=2))["provenance"]["kv_note"]
    assert "vision tower" in kv and "MoE" in kv and "kv_cache_tokens" in kv
    mixtral = prior_profile(shape_from_config(MIXTRAL), "h100", serving=Serving(tensor_parallel_size=2))
    assert "MoE buffers" in mixtral["provenance"]["kv_note"] and "vision" not in mixtral["provenance"]["kv_note"]
    assert "kv_note" not in prior_profile(shape_from_config(config("llama-3.1-8b-instruct")), "h100")["provenance"]


def test_beyond_four_gpus_the_profile_says_its_all_reduce_rate_was_fitted_on_fewer():
    s = shape_from_config(config("llama-3.1-70b-instruct"))
    for tp in (8, 16):
        notes = [n for n in prior_profile(s, "h100", serving=Serving(tensor_parallel_size=tp))["provenance"]["notes"]
                 if n.startswith(f"TP {tp}:")]
        assert len(notes) == 1 and f"a loaded step at TP {tp} reads as an upper end" in notes[0]
    assert not any(n.startswith("TP ") for n in
                   prior_profile(s, "h100", serving=Serving(tensor_parallel_size=4))["provenance"]["notes"])


def test_scenario_check_says_the_kv_note_unless_the_scenario_gives_its_kv_cache(tmp_path, capsys):
    cfg = os.path.join(CONFIGS, "llama-4-scout-17b-16e-instruct-fp8-dynamic", "config.json")
    model = f'[model]\nhf_config = "{os.path.abspath(cfg)}"\ngpu = "h100"\ntensor_parallel_size = 2\ncapacity = 1.0\n'
    for engine, said in (("", True), ("kv_cache_tokens = 132048", False), ("num_gpu_blocks = 8253", False),
                         ("gpu_memory_utilization = 0.85", True)):       # the last derived again: the note holds
        engine = f"[engine]\n{engine}\n" if engine else ""
        f = tmp_path / "scout.toml"
        f.write_text(model + engine)
        assert cli_main(["scenario", "check", str(f)]) == 0
        assert ("GPU KV cache size" in capsys.readouterr().out) == said


def test_kv_heads_are_replicated_beyond_their_count_and_refused_when_vllm_would():
    s = shape_from_config(config("llama-3.1-8b-instruct"))
    p = prior_profile(s, "h100", serving=Serving(tensor_parallel_size=16))
    assert p["kv_cache"]["kv_bytes_per_token"] == 2 * 32 * 1 * 128 * 2
    assert any("replica" in n for n in p["provenance"]["notes"])
    with pytest.raises(ValueError, match="does not divide the 32 attention heads"):
        prior_profile(s, "h100", serving=Serving(tensor_parallel_size=3))
    odd = copy.deepcopy(config("llama-3.1-8b-instruct")) | {"num_key_value_heads": 6, "num_attention_heads": 24,
                                                          "head_dim": 128}
    with pytest.raises(ValueError, match="KV heads"):
        prior_profile(shape_from_config(odd), "h100", serving=Serving(tensor_parallel_size=4))


def test_weights_that_do_not_fit_and_no_memory_for_kv_are_refused():
    s = shape_from_config(config("llama-3.1-70b-instruct"))
    with pytest.raises(ValueError, match="does not fit: 131.4 GiB of weights per GPU"):
        prior_profile(s, "h100")
    with pytest.raises(ValueError, match="leaves no memory for the KV cache"):
        prior_profile(s, "h100", serving=Serving(tensor_parallel_size=2, gpu_memory_utilization=0.86))


def test_cpu_offload_moves_weights_out_of_memory_onto_every_step():
    s = shape_from_config(config("llama-3.1-8b-instruct"))
    base = prior_profile(s, "l4")
    off = prior_profile(s, "l4", serving=Serving(cpu_offload_gb=4))
    assert base["kv_cache"]["weights_bytes"] - off["kv_cache"]["weights_bytes"] == 4 * GiB
    assert off["engine"]["num_gpu_blocks"] > base["engine"]["num_gpu_blocks"]
    extra = off["step_time"]["fixed_s"] - base["step_time"]["fixed_s"]
    assert extra == pytest.approx(4 * GiB / (CATALOGUE["l4"].host_bandwidth * 0.8), rel=1e-9)
    with pytest.raises(ValueError, match="exceeds"):
        prior_profile(s, "l4", serving=Serving(cpu_offload_gb=100))


def test_a_moe_step_reads_the_experts_its_tokens_route_to():
    p = prior_profile(shape_from_config(MIXTRAL), "h100", serving=Serving(tensor_parallel_size=2))
    st = from_dict(p).step_time
    assert isinstance(st, MoEStepTimeModel) and (st.experts, st.experts_per_token) == (8, 2)
    assert st.experts_read_s(1) == pytest.approx(st.expert_weights_s * 2 / 8, rel=1e-12)
    assert st.experts_read_s(2048) == pytest.approx(st.expert_weights_s, rel=1e-9)
    assert st.duration(1, 1, 0, 100) < st.duration(8, 8, 0, 800) < st.duration(64, 64, 0, 6400)
    # a decode step of 11 runs in the CUDA graph of 16: its padding rows are routed too
    assert st.experts_read_s(11) == pytest.approx(st.expert_weights_s * (1 - (6 / 8) ** 16), rel=1e-12)
    assert st.experts_read_s(11) == st.experts_read_s(16) > st.experts_read_s(8)
    assert [graph_tokens(n) for n in (1, 2, 3, 4, 5, 9, 248, 250, 257, 512, 513, 2048)] == [
        1, 2, 4, 4, 8, 16, 248, 256, 272, 512, 513, 2048]


def test_moe_fast_forward_is_the_sum_of_its_steps():
    st = step_time_model(prior_profile(shape_from_config(MIXTRAL), "h100",
                                       serving=Serving(tensor_parallel_size=2))["step_time"])
    n, ctx, m = 12, 12 * 700.0, 40
    steps = sum(st.duration(n, n, 0, ctx + n * i) for i in range(m))
    assert st.fast_forward_duration(n, ctx, m) == pytest.approx(steps, rel=1e-9)
    end = 5.0 + steps
    assert st.fast_forward_steps_before(n, ctx, 5.0, end) == m - 1


def test_a_moe_profile_without_its_routing_is_refused():
    d = prior_profile(shape_from_config(MIXTRAL), "h100", serving=Serving(tensor_parallel_size=2))
    del d["step_time"]["experts"]
    with pytest.raises(ProfileError, match="step_time.experts"):
        from_dict(d)
    old = prior_profile(shape_from_config(MIXTRAL), "h100", serving=Serving(tensor_parallel_size=2))
    del old["step_time"]["expert_per_token_s"]          # a moe profile derived before the experts' own compute
    with pytest.raises(ProfileError, match=r"lacks step_time.expert_per_token_s .*derive the profile again"):
        from_dict(old)
    with pytest.raises(ValueError, match="form moe"):
        step_time(shape_from_config(MIXTRAL), CATALOGUE["h100"], 0.6, 0.8, form="linear")


@pytest.mark.parametrize("cfg,match", [
    ({"hidden_size": 10}, "lacks num_hidden_layers"),
    (dict(MIXTRAL, quantization_config={"quant_method": "awq"}), "'awq' is not modelled"),
    (dict(MIXTRAL, architectures=["DeepseekV3ForCausalLM"], kv_lora_rank=512), "latent attention"),
    (dict(MIXTRAL, num_experts_per_tok=None), "lacks num_experts_per_tok"),
])
def test_configs_that_cannot_be_read_say_why(cfg, match):
    with pytest.raises(ValueError, match=match):
        shape_from_config(cfg)


def test_name_of_config():
    assert name_of_config("/m/llama-3.1-70b/config.json") == "llama-3.1-70b"
    assert name_of_config("/m/70b.json") == "70b"


def _llmsim(*argv, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "llmsim", *argv], capture_output=True, text=True, cwd=cwd)


def test_cli_prior_with_tp_fp8_and_a_reported_gpu_name(tmp_path):
    out = tmp_path / "p.json"
    r = _llmsim("calibrate", "prior", "--config",
                os.path.join(CONFIGS, "llama-4-scout-17b-16e-instruct-fp8-dynamic", "config.json"),
                "--gpu", "NVIDIA A100-SXM4-80GB", "--tp", "2", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "x 2" in r.stdout and "form moe" in r.stdout and "no FP8 tensor cores" in r.stdout
    p = json.loads(out.read_text())
    assert p["name"] == "llama-4-scout-17b-16e-instruct-fp8-dynamic" and p["serving"]["tensor_parallel_size"] == 2
    from_dict(p)


def test_cli_prior_takes_the_kv_cache_the_server_reported(tmp_path):
    out, cfg = tmp_path / "p.json", os.path.join(CONFIGS, "llama-4-scout-17b-16e-instruct-fp8-dynamic", "config.json")
    r = _llmsim("calibrate", "prior", "--config", cfg, "--tp", "2", "--kv-cache-tokens", "132050", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "8253 blocks of 16 (132048 tokens)" in r.stdout and "as the server reported them" in r.stdout
    assert "GPU KV cache size" not in r.stdout          # the note saying to give it is gone once it is given
    p = json.loads(out.read_text())
    assert from_dict(p).engine["num_gpu_blocks"] == 8253 and "kv_note" not in p["provenance"]
    r = _llmsim("calibrate", "prior", "--config", cfg, "--tp", "2", "--kv-cache-tokens", "8", "-o", str(out))
    assert r.returncode == 2 and "less than one block of 16 tokens" in r.stderr and len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize("argv,match", [
    (["--gpu", "h101"], "unknown GPU 'h101': the catalogue has h100"),
    (["--tp", "3"], "does not divide the 64 attention heads"),
    (["--tp", "1"], "does not fit"),
])
def test_cli_prior_refusals_are_one_line(tmp_path, argv, match):
    r = _llmsim("calibrate", "prior", "--config", os.path.join(CONFIGS, "llama-3.1-70b-instruct", "config.json"),
                *argv, "-o", str(tmp_path / "p.json"))
    assert r.returncode != 0 and match in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "p.json").exists()


def test_a_scenario_serves_its_model_on_four_gpus(tmp_path):
    cfg = tmp_path / "llama-3.1-70b" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(config("llama-3.1-70b-instruct")))
    (tmp_path / "s.toml").write_text('name = "tp4"\n[model]\nhf_config = "llama-3.1-70b/config.json"\n'
                                     'gpu = "h100"\ntensor_parallel_size = 4\n')
    r = _llmsim("scenario", "show", str(tmp_path / "s.toml"))
    assert r.returncode == 0, r.stderr
    assert "tensor_parallel_size = 4" in r.stdout
    (tmp_path / "bad.toml").write_text('[model]\nprofile = "qwen2.5-7b"\ntensor_parallel_size = 4\n')
    r = _llmsim("scenario", "show", str(tmp_path / "bad.toml"))
    assert r.returncode != 0 and "model.tensor_parallel_size" in r.stderr and "hf_config" in r.stderr
    (tmp_path / "one.toml").write_text('[model]\nhf_config = "llama-3.1-70b/config.json"\ngpu = "h100"\n')
    r = _llmsim("scenario", "show", str(tmp_path / "one.toml"))
    assert r.returncode != 0 and "does not fit" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _parsed(*argv):
    from llmsim.cli import build_parser
    return build_parser().parse_args(list(argv))


def test_from_bench_derives_the_engine_it_refits_from_a_config(tmp_path):
    from llmsim.calibrate_cmds import _base_profile, _engine_flags
    cfg = os.path.join(CONFIGS, "llama-3.1-8b-instruct", "config.json")
    a = _parsed("calibrate", "from-bench", "r.json", "--config", cfg, "--gpu", "NVIDIA L40S", "--max-model-len",
                "4096", "-o", str(tmp_path / "p.json"))
    p = _base_profile(a, "from-bench")
    assert p.raw["hardware"]["name"] == "NVIDIA L40S" and p.engine["max_model_len"] == 4096
    assert p.step_time.form == "roofline" and p.provenance["efficiencies"]["mfu"] > 0
    assert p.raw["capacity_protocol"]["scenario_name"] == "scaled"      # the reference calls do not fit 4096
    assert "--config" in _engine_flags(a) and "--gpu l40s" in _engine_flags(a)


@pytest.mark.parametrize("engine", [[], ["--profile", "qwen2.5-7b", "--config", "c.json"]])
def test_from_bench_takes_one_engine(tmp_path, engine):
    r = _llmsim("calibrate", "from-bench", os.path.join(ROOT, "tests", "data", "vllm-bench-serve", "r3.json"),
                *engine, "-o", str(tmp_path / "p.json"))
    assert r.returncode != 0 and "--profile NAME|FILE, or derive it with --config" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_the_worked_example_gets_its_verdict_on_a_derived_engine(tmp_path):
    """docs/any-model.md: Llama-3.1-70B on four H100s behind the OpenAI SDK;
    diagnose and a fleet of two such engines run on the derived profile."""
    ex = os.path.join(ROOT, "examples", "llama70b-tp4-openai.toml")
    r = _llmsim("diagnose", "--scenario", ex, "--seeds", "2", "--json", str(tmp_path / "d.json"))
    assert r.returncode == 0, r.stderr
    assert "derived profile" in r.stdout and "no-retry+cancel" in r.stdout
    fleet = tmp_path / "fleet.toml"
    cfg = os.path.join(CONFIGS, "llama-3.1-70b-instruct", "config.json")
    fleet.write_text(f'name = "tp4-fleet"\n[model]\nhf_config = "{cfg}"\ngpu = "h100"\ntensor_parallel_size = 4\n'
                     '[fleet]\nreplicas = 2\nrouter = "least-outstanding"\n')
    r = _llmsim("run", "--scenario", str(fleet), "--condition", "cancel", "--json", str(tmp_path / "r.json"))
    assert r.returncode == 0, r.stderr
    rec = json.loads((tmp_path / "r.json").read_text())
    assert len(rec["replicas"]) == 2 and rec["profile_provenance"] == "roofline prior"
