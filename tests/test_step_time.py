"""The step-time model's two forms: the linear sum of the terms and the
roofline (each kernel the larger of its compute and its memory time: the
matrix products max(tokens' FLOPs, the weights' read), plus the attention and
the overheads), as a profile chooses with `step_time.form`."""
from __future__ import annotations

import copy
import math

import pytest

from sim.engine.step_time import RooflineStepTimeModel, StepTimeModel, step_time_model
from sim.profile import ProfileError, from_dict, load_profile
from sim.steps import predict
from sim.verdict import perturbed

# 1 ms overhead, 6 ms of weights, 20 us a token: the ridge point at 300 tokens
ROOF = RooflineStepTimeModel(fixed_s=1e-3, per_request_s=1e-5, per_token_s=2e-5, per_prefill_pair_s=1e-9,
                             per_decode_ctx_s=5e-8, weights_s=6e-3)


def test_a_decode_batch_below_the_ridge_point_pays_the_weights_read_not_its_tokens():
    # 40 decodes of 1000-token context: matrix products 0.8 ms < the weights' 6 ms; KV read 2 ms
    assert ROOF.duration(40, 40, 0.0, 40_000) == pytest.approx(1e-3 + 40e-5 + 6e-3 + 2e-3)
    # twice the batch, same context per request: only the context read grows
    grow = ROOF.duration(80, 80, 0.0, 80_000) - ROOF.duration(40, 40, 0.0, 40_000)
    assert grow == pytest.approx(40e-5 + 2e-3)
    linear = StepTimeModel(**{k: getattr(ROOF, k) for k in StepTimeModel.coefficients})
    assert linear.duration(80, 80, 0.0, 80_000) - linear.duration(40, 40, 0.0, 40_000) > grow + 40 * 2e-5 * 0.99


def test_a_step_above_the_ridge_point_pays_its_tokens_not_the_weights_read():
    pairs = 2048 * (2048 + 1) / 2.0
    # a 2048-token chunk beside 40 decodes: 41 ms of matrix products hide the 6 ms read
    got = ROOF.duration(41, 2088, pairs, 40_000)
    assert got == pytest.approx(1e-3 + 41e-5 + 2e-5 * 2088 + 1e-9 * pairs + 2e-3)
    # at the ridge point (300 tokens) the two bounds meet: continuous
    assert ROOF.duration(1, 299.999, 0.0, 0.0) == pytest.approx(ROOF.duration(1, 300.001, 0.0, 0.0), rel=1e-5)


@pytest.mark.parametrize("n, ctx", [(10, 1_000), (400, 0), (400, 50_000), (600, 200), (1, 0), (0, 0)])
def test_roofline_fast_forward_is_the_sum_of_its_steps(n, ctx):
    # n=400 and 600: above the ridge point, the decode batch's tokens cost more than the weights' read
    total = 0.0
    for m in range(1, 300):
        total += ROOF.duration(n, n, 0.0, ctx + n * (m - 1))
        assert ROOF.fast_forward_duration(n, ctx, m) == pytest.approx(total, rel=1e-9)
    for t in (1e-4, 5e-3, 0.05, 0.4, 2.0):
        done = ROOF.fast_forward_steps_before(n, ctx, 1.0, 1.0 + t)
        assert ROOF.fast_forward_duration(n, ctx, done) < t <= ROOF.fast_forward_duration(n, ctx, done + 1)


def test_steps_taking_no_time_all_end_before_any_time():
    zero = RooflineStepTimeModel(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert zero.fast_forward_steps_before(5, 100.0, 0.0, 1.0) == 1 << 30


def _roofline_profile() -> dict:
    d = copy.deepcopy(load_profile("qwen3-14b").raw)
    d["step_time"] = ROOF.to_dict()
    return d


def test_a_profile_chooses_its_form_and_keeps_it_in_json():
    prof = from_dict(_roofline_profile(), "r.json")
    assert isinstance(prof.step_time, RooflineStepTimeModel) and prof.step_time == ROOF
    assert prof.step_time.to_dict()["form"] == "roofline"
    linear = load_profile("qwen3-14b")
    assert type(linear.step_time) is StepTimeModel and "form" not in linear.step_time.to_dict()
    assert step_time_model(linear.step_time.to_dict()) == linear.step_time


@pytest.mark.parametrize("change, msg", [
    ({"form": "sum"}, "step_time.form must be one of linear, roofline"),
    ({"weights_s": None}, "step_time lacks step_time.weights_s"),
    ({"weights_s": -1e-3}, "step_time.weights_s must be a finite non-negative number"),
])
def test_a_malformed_roofline_step_time_is_refused(change, msg):
    d = _roofline_profile()
    for k, v in change.items():
        if v is None:
            del d["step_time"][k]
        else:
            d["step_time"][k] = v
    with pytest.raises(ProfileError, match=msg):
        from_dict(d, "r.json")


def test_a_perturbed_roofline_engine_scales_every_term():
    prof = from_dict(_roofline_profile(), "r.json")
    slow = perturbed(prof, speed=1.5)
    assert isinstance(slow.step_time, RooflineStepTimeModel)
    for k in RooflineStepTimeModel.coefficients:
        assert getattr(slow.step_time, k) == pytest.approx(1.5 * getattr(ROOF, k))
    assert slow.step_time.duration(40, 40, 0.0, 40_000) == pytest.approx(1.5 * ROOF.duration(40, 40, 0.0, 40_000))


def test_step_rows_are_predicted_by_the_profiles_form():
    rows = [{"num_reqs": 40, "num_tokens": 40, "prefill_pairs": 0.0, "decode_ctx": 40_000.0},
            {"num_reqs": 1, "num_tokens": 2048, "prefill_pairs": 2048 * 2049 / 2.0, "decode_ctx": 0.0}]
    got = predict(ROOF, rows)
    assert all(math.isclose(g, ROOF.duration(r["num_reqs"], r["num_tokens"], r["prefill_pairs"], r["decode_ctx"]))
               for g, r in zip(got, rows))


def test_tensor_parallel_all_reduces_add_to_the_step_whatever_bounds_its_matrix_products():
    comm = RooflineStepTimeModel(**{k: getattr(ROOF, k) for k in RooflineStepTimeModel.coefficients},
                                 comm_per_token_s=3e-6)
    # below the ridge point the tokens' FLOPs hide under the weights' read; the all-reduces do not
    assert comm.duration(40, 40, 0.0, 40_000) - ROOF.duration(40, 40, 0.0, 40_000) == pytest.approx(40 * 3e-6)
    assert comm.duration(1, 2048, 0.0, 0.0) - ROOF.duration(1, 2048, 0.0, 0.0) == pytest.approx(2048 * 3e-6)
    total = 0.0
    for m in range(1, 50):
        total += comm.duration(30, 30, 0.0, 5_000 + 30 * (m - 1))
    assert comm.fast_forward_duration(30, 5_000, 49) == pytest.approx(total, rel=1e-9)
    assert comm.scaled(2.0).comm_per_token_s == pytest.approx(6e-6)
    # written when not 0, read back; a profile without it has none (the embedded ones keep their JSON)
    d = _roofline_profile()
    d["step_time"] = comm.to_dict()
    assert from_dict(d, "r.json").step_time == comm
    assert "comm_per_token_s" not in ROOF.to_dict()
    d["step_time"]["comm_per_token_s"] = -1.0
    with pytest.raises(ProfileError, match="comm_per_token_s must be a finite non-negative number"):
        from_dict(d, "r.json")


def test_large_all_reduces_run_in_their_bulk_regime():
    """Past the knee (here 512 tokens) a step's all-reduces grow at the bulk
    rate: min(small x n, bulk_fixed + bulk x n)."""
    small, bulk, knee = 3e-6, 0.5e-6, 512
    comm = RooflineStepTimeModel(**{k: getattr(ROOF, k) for k in RooflineStepTimeModel.coefficients},
                                 comm_per_token_s=small, comm_bulk_fixed_s=(small - bulk) * knee,
                                 comm_bulk_per_token_s=bulk)
    assert comm.comm_s(40) == pytest.approx(40 * small)
    assert comm.comm_s(knee) == pytest.approx(knee * small)
    assert comm.comm_s(8192) == pytest.approx(knee * small + (8192 - knee) * bulk)
    for n in (40, 8192):
        assert comm.duration(1, n, 0.0, 0.0) - ROOF.duration(1, n, 0.0, 0.0) == pytest.approx(comm.comm_s(n))
    total = sum(comm.duration(600, 600, 0.0, 60_000 + 600 * m) for m in range(20))   # decode past the knee
    assert comm.fast_forward_duration(600, 60_000, 20) == pytest.approx(total, rel=1e-9)
    assert comm.scaled(2.0).comm_s(8192) == pytest.approx(2 * comm.comm_s(8192))
    d = _roofline_profile()
    d["step_time"] = comm.to_dict()
    assert from_dict(d, "r.json").step_time == comm
    d["step_time"]["comm_bulk_per_token_s"] = -1.0
    with pytest.raises(ProfileError, match="comm_bulk_per_token_s must be a finite non-negative number"):
        from_dict(d, "r.json")
