"""grpo.py: every number below is computed by hand (torchtune style) and written out."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from vlmrl import grpo

E = math.e
NAN = float("nan")


def scalar(x: float) -> torch.Tensor:
    return torch.tensor(x)


def one_token(log_ratio: float):
    """A (1, 1) batch: logp (requires grad) = log_ratio, old_logp = 0, mask = 1."""
    logp = torch.tensor([[log_ratio]], requires_grad=True)
    return logp, torch.zeros(1, 1), torch.ones(1, 1)


# ---------------------------------------------------------------- group advantages

def test_group_advantages_population_std_and_constant_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    # group 0: mean 0.5, population std 0.5 -> +-0.5 / (0.5 + 1e-6); group 1: all equal -> 0.
    a = 0.5 / (0.5 + 1e-6)
    assert_close(grpo.group_advantages(rewards, 4),
                 torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0]))


def test_group_advantages_is_exactly_plus_minus_one_without_eps():
    # population std of [1, 0, 0, 1] is 0.5 (the sample std would be 0.577 and give +-0.866).
    out = grpo.group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, eps=0.0)
    assert_close(out, torch.tensor([1.0, -1.0, -1.0, 1.0]), rtol=0, atol=0)


def test_group_advantages_two_completions():
    # G = 2, rewards 0 and 3: mean 1.5, population std 1.5 -> -1, +1 (sample std: -0.707, +0.707).
    out = grpo.group_advantages(torch.tensor([0.0, 3.0]), 2, eps=0.0)
    assert_close(out, torch.tensor([-1.0, 1.0]))


def test_group_advantages_scale_none_is_reward_minus_group_mean():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 5.0])
    # group means 0.5 and 2.75
    assert_close(grpo.group_advantages(rewards, 4, scale="none"),
                 torch.tensor([0.5, -0.5, -0.5, 0.5, -0.75, -0.75, -0.75, 2.25]))


def test_group_advantages_scale_batch_divides_by_one_std_for_the_batch():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    # centred: [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]; sum of squares 1, sample std sqrt(1 / 7).
    a = 0.5 / (math.sqrt(1 / 7) + 1e-6)
    assert_close(grpo.group_advantages(rewards, 4, scale="batch"),
                 torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0]))


def test_group_advantages_rejects_ragged_groups_and_unknown_scale():
    with pytest.raises(ValueError, match="multiple of group_size"):
        grpo.group_advantages(torch.zeros(7), 4)
    with pytest.raises(ValueError, match="scale"):
        grpo.group_advantages(torch.zeros(4), 4, scale="std")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-5, 5), min_size=8, max_size=8))
def test_group_advantages_have_zero_mean_and_unit_rms_per_group(values):
    out = grpo.group_advantages(torch.tensor(values, dtype=torch.float32), 4).reshape(2, 4)
    assert_close(out.mean(1), torch.zeros(2), atol=1e-5, rtol=0)
    for group, adv in zip(torch.tensor(values).reshape(2, 4), out):
        expected = 0.0 if bool((group == group[0]).all()) else 1.0
        assert_close(adv.pow(2).mean().sqrt(), scalar(expected), atol=1e-4, rtol=0)


# ---------------------------------------------------------------- cubic shaping

def test_cubic_shaping_cubes_and_keeps_sign():
    assert_close(grpo.cubic_shaping(torch.tensor([2.0, -0.5, 0.0, 1.0, -3.0])),
                 torch.tensor([8.0, -0.125, 0.0, 1.0, -27.0]))


def test_cubic_shaping_per_group_keeps_rms():
    # group [3, -1, -1, -1]: rms sqrt(12/4) = sqrt(3); cubed [27, -1, -1, -1] has rms sqrt(732/4) =
    # sqrt(183); scale sqrt(3/183) = 1/sqrt(61). The outlier grows (3 -> 3.457), the rest shrink.
    # Group of zeros stays zeros (no 0/0).
    s = 1 / math.sqrt(61)
    out = grpo.cubic_shaping(torch.tensor([3.0, -1.0, -1.0, -1.0, 0.0, 0.0, 0.0, 0.0]), group_size=4)
    assert_close(out, torch.tensor([27 * s, -s, -s, -s, 0.0, 0.0, 0.0, 0.0]))
    assert_close(out[0], scalar(3.4569957))


def test_shape_advantages_names_each_shaping():
    adv = torch.tensor([3.0, -1.0, -1.0, -1.0])
    assert torch.equal(grpo.shape_advantages(adv, 4, "none"), adv)
    assert_close(grpo.shape_advantages(adv, 4, "cubic"), torch.tensor([27.0, -1.0, -1.0, -1.0]))
    s = 1 / math.sqrt(61)  # as in the test above
    assert_close(grpo.shape_advantages(adv, 4, "cubic_rescaled"), torch.tensor([27 * s, -s, -s, -s]))
    with pytest.raises(ValueError, match="shaping"):
        grpo.shape_advantages(adv, 4, "square")


# ---------------------------------------------------------------- DAPO reward shaping and sampling

def test_overlong_penalty_values():
    lengths = torch.tensor([10, 15, 16, 18, 20, 25])
    # max 20, buffer 5: free up to 15 tokens, then -1/5 per token, -1 from 20 on.
    assert_close(grpo.overlong_penalty(lengths, 20, 5),
                 torch.tensor([0.0, 0.0, -0.2, -0.6, -1.0, -1.0]))
    assert_close(grpo.overlong_penalty(lengths, 20, 5, penalty=0.5),
                 torch.tensor([0.0, 0.0, -0.1, -0.3, -0.5, -0.5]))


def test_overlong_penalty_off_and_invalid_buffer():
    assert_close(grpo.overlong_penalty(torch.tensor([3, 20]), 20, 0), torch.zeros(2))
    with pytest.raises(ValueError, match="buffer"):
        grpo.overlong_penalty(torch.tensor([3]), 20, 21)
    with pytest.raises(ValueError, match="buffer"):
        grpo.overlong_penalty(torch.tensor([3]), 20, -1)


def test_dynamic_sampling_mask():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.5])
    assert grpo.dynamic_sampling_mask(rewards, 4).tolist() == [True, False, True]
    with pytest.raises(ValueError):
        grpo.dynamic_sampling_mask(rewards, 5)


# ---------------------------------------------------------------- KL estimators

def test_kl_estimators_at_known_log_ratio():
    logp, ref = torch.zeros(1, 1), torch.full((1, 1), math.log(0.5))
    # d = ref - logp = -log 2
    assert_close(grpo.kl_penalty(logp, ref, "k1"), torch.tensor([[math.log(2)]]))  # 0.693147
    assert_close(grpo.kl_penalty(logp, ref, "k2"), torch.tensor([[0.5 * math.log(2) ** 2]]))  # 0.240227
    assert_close(grpo.kl_penalty(logp, ref, "k3"), torch.tensor([[0.5 + math.log(2) - 1]]))  # 0.193147
    assert_close(grpo.kl_penalty(logp, ref, "k3"), torch.tensor([[0.1931472]]))


def test_kl_is_zero_at_the_reference_and_clamped_far_away():
    logp = torch.tensor([[-1.3, -0.2]])
    assert_close(grpo.kl_penalty(logp, logp.clone(), "k3"), torch.zeros(1, 2))
    far = grpo.kl_penalty(torch.zeros(1, 2), torch.tensor([[100.0, -100.0]]), "k3")
    # d clamped to +-20: exp(20) - 21 and exp(-20) + 19
    assert_close(far, torch.tensor([[math.exp(20) - 21, math.exp(-20) + 19]]))
    with pytest.raises(ValueError):
        grpo.kl_penalty(logp, logp, "k4")


@settings(max_examples=100, deadline=None)
@given(st.floats(-40, 40), st.floats(-40, 40))
def test_k3_is_never_negative(logp, ref):
    value = grpo.kl_penalty(torch.tensor([[logp]]), torch.tensor([[ref]]), "k3")
    assert torch.isfinite(value).all() and float(value) >= 0.0


# ---------------------------------------------------------------- aggregation

# row 0 has tokens 1, 2, 3 (and NaN padding), row 1 has token 6.
VALUES = torch.tensor([[1.0, 2.0, 3.0, NAN], [6.0, NAN, NAN, NAN]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize(("mode", "max_len", "expected"), [
    ("token", None, 3.0),      # (1 + 2 + 3 + 6) / 4 tokens
    ("sequence", None, 4.0),   # (mean(1, 2, 3) = 2  +  6) / 2 rows
    ("constant", 4, 1.5),      # 12 / (2 rows * 4)
    ("constant", 6, 1.0),      # 12 / (2 rows * 6)
])
def test_aggregate_modes_on_a_ragged_mask(mode, max_len, expected):
    assert_close(grpo.aggregate(VALUES, MASK, mode, max_len), scalar(expected))


@pytest.mark.parametrize("mode", ["token", "sequence", "constant"])
def test_aggregate_empty_mask_is_zero(mode):
    assert_close(grpo.aggregate(VALUES, torch.zeros(2, 4), mode, 4), scalar(0.0))


def test_aggregate_sequence_counts_empty_rows_and_constant_needs_max_len():
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])
    assert_close(grpo.aggregate(VALUES, mask, "sequence"), scalar(1.0))  # (2 + 0) / 2 rows
    with pytest.raises(ValueError, match="max_len"):
        grpo.aggregate(VALUES, MASK, "constant")
    with pytest.raises(ValueError):
        grpo.aggregate(VALUES, MASK, "mean")


def test_masked_mean():
    assert_close(grpo.masked_mean(VALUES, MASK), scalar(3.0))
    assert_close(grpo.masked_mean(VALUES, MASK, dim=-1), torch.tensor([2.0, 6.0]))


# ---------------------------------------------------------------- clipped surrogate, token level

def test_ratio_e_positive_advantage_is_clipped_to_1_2():
    logp, old, mask = one_token(1.0)
    out = grpo.policy_loss(logp, grpo.LossInputs(old, torch.tensor([1.0]), mask))
    # min(e * 1, clip(e, 0.8, 1.2) * 1) = 1.2
    assert_close(out.loss, scalar(-1.2))
    assert_close(out.pg_loss, scalar(-1.2))
    assert_close(out.clip_fraction, scalar(1.0))
    assert_close(out.clip_high_fraction, scalar(1.0))
    assert_close(out.clip_low_fraction, scalar(0.0))
    assert_close(out.ratio_mean, scalar(E))
    out.loss.backward()
    assert_close(logp.grad, torch.zeros(1, 1))  # clipped: no gradient


def test_ratio_inverse_e_positive_advantage_is_not_clipped():
    logp, old, mask = one_token(-1.0)
    out = grpo.policy_loss(logp, grpo.LossInputs(old, torch.tensor([1.0]), mask))
    # min(0.3679, 0.8) = 0.3679
    assert_close(out.loss, scalar(-0.3678794))
    assert_close(out.clip_fraction, scalar(0.0))
    out.loss.backward()
    assert_close(logp.grad, torch.tensor([[-math.exp(-1)]]))  # d(-w A)/d logp = -w A


def test_negative_advantage_ratio_e_is_not_clipped():
    logp, old, mask = one_token(1.0)
    out = grpo.policy_loss(logp, grpo.LossInputs(old, torch.tensor([-1.0]), mask))
    # -min(-e, -1.2) = e: a worse action made more likely is penalised in full
    assert_close(out.loss, scalar(E))
    assert_close(out.clip_fraction, scalar(0.0))
    out.loss.backward()
    assert_close(logp.grad, torch.tensor([[E]]))


def test_negative_advantage_ratio_inverse_e_is_clipped_to_0_8():
    logp, old, mask = one_token(-1.0)
    out = grpo.policy_loss(logp, grpo.LossInputs(old, torch.tensor([-1.0]), mask))
    # -min(-0.3679, -0.8) = 0.8
    assert_close(out.loss, scalar(0.8))
    assert_close(out.clip_fraction, scalar(1.0))
    assert_close(out.clip_low_fraction, scalar(1.0))
    assert_close(out.clip_high_fraction, scalar(0.0))
    out.loss.backward()
    assert_close(logp.grad, torch.zeros(1, 1))


def test_dual_clip_caps_negative_advantage_loss():
    logp, old, mask = one_token(1.0)
    loose = grpo.policy_loss(logp, grpo.LossInputs(old, torch.tensor([-1.0]), mask), grpo.LossSettings(dual_clip=3.0))
    assert_close(loose.loss, scalar(E))  # e < 3: untouched
    assert_close(loose.clip_fraction, scalar(0.0))
    tight = grpo.policy_loss(logp, grpo.LossInputs(old, torch.tensor([-1.0]), mask), grpo.LossSettings(dual_clip=2.0))
    assert_close(tight.loss, scalar(2.0))  # min(e, 2 * |A|)
    assert_close(tight.clip_fraction, scalar(1.0))
    tight.loss.backward()
    assert_close(logp.grad, torch.zeros(1, 1))
    with pytest.raises(ValueError, match="dual_clip"):
        grpo.policy_loss(logp, grpo.LossInputs(old, torch.tensor([-1.0]), mask), grpo.LossSettings(dual_clip=1.0))


def test_clip_higher_changes_the_answer():
    logp, old, mask = one_token(math.log(1.25))
    grpo_out = grpo.policy_loss(logp, grpo.LossInputs(old, torch.tensor([1.0]), mask), grpo.LossSettings(eps_high=0.2))
    dapo_out = grpo.policy_loss(logp, grpo.LossInputs(old, torch.tensor([1.0]), mask), grpo.LossSettings(eps_high=0.28))
    assert_close(grpo_out.loss, scalar(-1.2))   # 1.25 clipped to 1.2
    assert_close(dapo_out.loss, scalar(-1.25))  # 1.25 < 1.28: unclipped
    assert_close(grpo_out.clip_fraction, scalar(1.0))
    assert_close(dapo_out.clip_fraction, scalar(0.0))
    # eps_low is separate: ratio 0.75 with A < 0 clips at 0.8 whatever eps_high is
    logp_low, _, _ = one_token(math.log(0.75))
    low = grpo.policy_loss(logp_low, grpo.LossInputs(old, torch.tensor([-1.0]), mask), grpo.LossSettings(eps_low=0.2, eps_high=0.28))
    assert_close(low.loss, scalar(0.8))


def test_clip_fraction_counts_valid_tokens_only():
    # tokens: ratio e (clipped), ratio 1, ratio e^-1 (not clipped for A > 0), padding with ratio e^5
    logp = torch.tensor([[1.0, 0.0, -1.0, 5.0]], requires_grad=True)
    out = grpo.policy_loss(logp, grpo.LossInputs(torch.zeros(1, 4), torch.tensor([1.0]), torch.tensor([[1, 1, 1, 0]])))
    assert_close(out.clip_fraction, scalar(1 / 3))
    assert_close(out.ratio_mean, scalar((E + 1 + math.exp(-1)) / 3))
    # sequence mean: -(1.2 + 1 + e^-1) / 3
    assert_close(out.loss, scalar(-(1.2 + 1 + math.exp(-1)) / 3))


# ---------------------------------------------------------------- ratio 1: REINFORCE gradient

LOGP = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -3.0, -0.7]])
RAGGED = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADV = torch.tensor([1.5, -0.5])


@pytest.mark.parametrize(("aggregation", "normaliser"), [
    ("token", torch.tensor([[5.0], [5.0]])),       # 5 valid tokens in the batch
    ("sequence", torch.tensor([[6.0], [4.0]])),    # B * len_i = 2 * 3, 2 * 2
    ("constant", torch.tensor([[8.0], [8.0]])),    # B * max_len = 2 * 4
])
def test_ratio_one_gives_reinforce_gradient(aggregation, normaliser):
    logp = LOGP.clone().requires_grad_(True)
    out = grpo.policy_loss(logp, grpo.LossInputs(logp.detach(), ADV, RAGGED), grpo.LossSettings(aggregation=aggregation, max_len=4))
    out.loss.backward()
    expected = -ADV.unsqueeze(-1) * RAGGED / normaliser  # (2, 3)
    assert_close(logp.grad, expected)
    assert_close(out.ratio_mean, scalar(1.0))
    assert_close(out.clip_fraction, scalar(0.0))
    # value: -sum(A_i * len_i) / ..., e.g. token: -(1.5 * 3 - 0.5 * 2) / 5 = -0.7
    value = {"token": -0.7, "sequence": -(1.5 - 0.5) / 2, "constant": -3.5 / 8}[aggregation]
    assert_close(out.loss, scalar(value))


def test_all_zero_mask_gives_zero_loss_and_finite_gradient():
    logp = torch.tensor([[-0.5, float("-inf")], [0.3, 2.0]], requires_grad=True)
    for aggregation in ("token", "sequence", "constant"):
        for level in ("token", "sequence"):
            out = grpo.policy_loss(logp, grpo.LossInputs(torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.zeros(2, 2), ref_logp=torch.zeros(2, 2)), grpo.LossSettings(aggregation=aggregation, max_len=2, ratio_level=level, beta=0.1))
            for value in out:
                assert torch.isfinite(value).all() and float(value.detach()) == 0.0
            logp.grad = None
            out.loss.backward()
            assert_close(logp.grad, torch.zeros(2, 2))


def test_stats_are_detached():
    logp, old, mask = one_token(0.3)
    out = grpo.policy_loss(logp, grpo.LossInputs(old, torch.tensor([1.0]), mask, ref_logp=torch.zeros(1, 1)), grpo.LossSettings(beta=0.1))
    assert out.loss.requires_grad
    assert not any(t.requires_grad for t in (out.pg_loss, out.kl, out.clip_fraction, out.ratio_mean))


# ---------------------------------------------------------------- KL in the loss

def test_beta_adds_beta_times_kl_exactly():
    logp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.full((1, 2), math.log(0.5))
    k3 = 0.5 + math.log(2) - 1  # 0.193147 per token
    out = grpo.policy_loss(logp, grpo.LossInputs(logp.detach(), torch.tensor([1.0]), torch.ones(1, 2), ref_logp=ref), grpo.LossSettings(beta=0.1, kl_kind="k3"))
    assert_close(out.pg_loss, scalar(-1.0))
    assert_close(out.kl, scalar(k3))
    assert_close(out.loss, scalar(-1.0 + 0.1 * k3))  # -0.9806853
    out.loss.backward()
    # d/dlogp [-A w + beta k3] = -1 + 0.1 * (1 - exp(d)) = -1 + 0.1 * 0.5, over 2 tokens
    assert_close(logp.grad, torch.full((1, 2), -0.475))


def test_reference_without_beta_only_reports_kl():
    logp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.full((1, 2), math.log(0.5))
    out = grpo.policy_loss(logp, grpo.LossInputs(logp.detach(), torch.tensor([1.0]), torch.ones(1, 2), ref_logp=ref), grpo.LossSettings(kl_kind="k1"))
    assert_close(out.loss, scalar(-1.0))
    assert_close(out.kl, scalar(math.log(2)))
    no_ref = grpo.policy_loss(logp, grpo.LossInputs(logp.detach(), torch.tensor([1.0]), torch.ones(1, 2)))
    assert_close(no_ref.kl, scalar(0.0))
    with pytest.raises(ValueError, match="ref_logp"):
        grpo.policy_loss(logp, grpo.LossInputs(logp.detach(), torch.tensor([1.0]), torch.ones(1, 2)), grpo.LossSettings(beta=0.1))


# ---------------------------------------------------------------- GSPO: sequence-level ratio

def test_sequence_ratio_is_exp_of_mean_token_log_ratio():
    logp = torch.tensor([[0.1, 0.2, 0.6], [0.5, 1.5, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ratio = grpo.importance_ratio(logp, torch.zeros(2, 3), mask, "sequence")
    s0, s1 = math.exp(0.3), math.exp(1.0)  # mean(0.1, 0.2, 0.6), mean(0.5, 1.5)
    assert_close(ratio, torch.tensor([[s0, s0, s0], [s1, s1, 1.0]]))


def test_sequence_level_gradient_at_ratio_one_is_advantage_over_length():
    logp = LOGP.clone().requires_grad_(True)
    out = grpo.policy_loss(logp, grpo.LossInputs(logp.detach(), ADV, RAGGED), grpo.LossSettings(ratio_level="sequence"))
    out.loss.backward()
    # -(1/B) * A_i / len_i per valid token: -1.5 / 6 = -0.25, +0.5 / 4 = 0.125
    assert_close(logp.grad, torch.tensor([[-0.25, -0.25, -0.25], [0.125, 0.125, 0.0]]))
    single = LOGP[:1].clone().requires_grad_(True)
    grpo.policy_loss(single, grpo.LossInputs(single.detach(), torch.tensor([3.0]), torch.ones(1, 3)), grpo.LossSettings(ratio_level="sequence")).loss.backward()
    assert_close(single.grad, torch.full((1, 3), -1.0))  # -A / len = -3 / 3


def test_sequence_level_gradient_off_policy_is_s_times_advantage_over_length():
    logp = torch.tensor([[0.1, 0.2, 0.6]], requires_grad=True)
    out = grpo.policy_loss(logp, grpo.LossInputs(torch.zeros(1, 3), torch.tensor([2.0]), torch.ones(1, 3)), grpo.LossSettings(ratio_level="sequence", eps_high=0.5))
    s = math.exp(0.3)  # 1.3499 < 1.5: unclipped
    assert_close(out.loss, scalar(-2.0 * s))
    out.loss.backward()
    assert_close(logp.grad, torch.full((1, 3), -2.0 * s / 3))


def test_sequence_level_clips_the_whole_sequence():
    logp = torch.tensor([[0.1, 0.2, 0.6]], requires_grad=True)
    inputs = grpo.LossInputs(torch.zeros(1, 3), torch.tensor([1.0]), torch.ones(1, 3))
    # token level, eps 0.2: e^0.1 = 1.105 kept, e^0.2 = 1.221 and e^0.6 = 1.822 clipped to 1.2
    token = grpo.policy_loss(logp, inputs)
    assert_close(token.clip_fraction, scalar(2 / 3))
    assert_close(token.loss, scalar(-(math.exp(0.1) + 1.2 + 1.2) / 3))
    # GSPO clip ranges: s = e^0.3 > 1 + 4e-4 -> every token clipped to 1.0004
    seq = grpo.policy_loss(logp, inputs, grpo.LossSettings(ratio_level="sequence", eps_low=3e-4, eps_high=4e-4))
    assert_close(seq.clip_fraction, scalar(1.0))
    assert_close(seq.loss, scalar(-1.0004))
    seq.loss.backward()
    assert_close(logp.grad, torch.zeros(1, 3))


def test_unknown_ratio_level_is_rejected():
    with pytest.raises(ValueError, match="ratio_level"):
        grpo.importance_ratio(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "group")


def test_gspo_token_with_per_token_advantages_routes_gradient_per_token():
    # GSPO-token: w_t = sg[s] * exp(logp_t - sg[logp_t]), so d loss / d logp_t = -s * A_t / len.
    # (A plain broadcast of s would spread the gradient evenly: -s * mean(A) / len = -1/3 each.)
    logp = torch.zeros(1, 3, requires_grad=True)
    out = grpo.policy_loss(logp, grpo.LossInputs(logp.detach(), torch.tensor([[3.0, 0.0, 0.0]]), torch.ones(1, 3)), grpo.LossSettings(ratio_level="sequence"))
    assert_close(out.loss, scalar(-1.0))  # -(3 + 0 + 0) / 3
    out.loss.backward()
    assert_close(logp.grad, torch.tensor([[-1.0, 0.0, 0.0]]))


# ---------------------------------------------------------------- rollout/training mismatch (TIS)

TIS_ADV = torch.tensor([1.0, -2.0])  # (2,)
TIS_MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])  # (2, 2): three valid tokens


def tis_inputs(sampler_logp: torch.Tensor):
    """logp = old = 0 on every token (ratio 1): only the TIS weights move the loss."""
    logp = torch.zeros(2, 2, requires_grad=True)
    return logp, grpo.LossInputs(torch.zeros(2, 2), TIS_ADV, TIS_MASK, sampler_logp=sampler_logp)


def test_tis_weights_are_the_capped_ratio_of_training_to_sampler():
    # old - sampler = ln 2, ln 5, -ln 2 (and garbage on padding): weights 2, min(5, 3) = 3, 1/2; padding 1.
    sampler = torch.tensor([[-math.log(2), -math.log(5)], [math.log(2), 50.0]])
    weight, capped = grpo.tis_weights(torch.zeros(2, 2), sampler, TIS_MASK, grpo.LossSettings(tis_cap=3.0))
    assert_close(weight, torch.tensor([[2.0, 3.0], [0.5, 1.0]]))
    assert capped.tolist() == [[False, True], [False, False]]


def test_tis_reweights_each_tokens_surrogate_and_logs_the_mismatch():
    sampler = torch.tensor([[-math.log(2), -math.log(5)], [math.log(2), 0.0]])
    logp, inputs = tis_inputs(sampler)
    out = grpo.policy_loss(logp, inputs, grpo.LossSettings(aggregation="token", tis_cap=3.0))
    # per token -c_t * A: row 0 (A = 1): -2, -3; row 1 (A = -2): +1; token mean = (-2 - 3 + 1) / 3
    assert_close(out.loss, scalar(-4.0 / 3.0))
    out.loss.backward()
    assert_close(logp.grad, torch.tensor([[-2.0, -3.0], [1.0, 0.0]]) / 3.0)  # the weight is a constant
    assert_close(out.tis_weight_mean, scalar((2.0 + 3.0 + 0.5) / 3.0))
    assert_close(out.tis_capped_fraction, scalar(1.0 / 3.0))
    # k3 of KL(sampler || training), d = old - sampler: e^d - d - 1 = (1 - ln 2), (4 - ln 5), (ln 2 - 0.5)
    k3 = ((1 - math.log(2)) + (4 - math.log(5)) + (math.log(2) - 0.5)) / 3.0
    assert_close(out.mismatch_kl, scalar(k3))


def test_a_trained_mask_narrows_the_loss_but_not_the_mismatch_statistics():
    """80/20 (trained_mask: the high-entropy tokens) trains on fewer tokens; the sampler mismatch and TIS
    statistics still describe every sampled token, as the alarm's thresholds assume."""
    sampler = torch.tensor([[-math.log(2), -math.log(5)], [math.log(2), 0.0]])
    logp, inputs = tis_inputs(sampler)
    settings = grpo.LossSettings(aggregation="token", tis_cap=3.0)
    narrowed = grpo.policy_loss(logp, inputs._replace(trained_mask=torch.tensor([[1, 0], [0, 0]])), settings)
    assert_close(narrowed.loss, scalar(-2.0))  # row 0, token 0 alone: -c * A = -2 * 1
    full = grpo.policy_loss(logp, inputs, settings)
    assert_close(narrowed.mismatch_kl, full.mismatch_kl)  # (1 - ln 2 + 4 - ln 5 + ln 2 - 0.5) / 3
    assert_close(narrowed.tis_weight_mean, scalar((2.0 + 3.0 + 0.5) / 3.0))
    assert_close(narrowed.tis_capped_fraction, scalar(1.0 / 3.0))


def test_tis_off_logs_the_mismatch_and_leaves_the_loss():
    sampler = torch.tensor([[-math.log(2), -math.log(5)], [math.log(2), 0.0]])
    logp, inputs = tis_inputs(sampler)
    off = grpo.policy_loss(logp, inputs, grpo.LossSettings(aggregation="token"))
    plain = grpo.policy_loss(logp, inputs._replace(sampler_logp=None), grpo.LossSettings(aggregation="token"))
    assert_close(off.loss, plain.loss)  # -(1 + 1 - 2) / 3 = 0
    assert off.mismatch_kl > 0 and plain.mismatch_kl == 0
    assert_close(off.tis_weight_mean, scalar(1.0))
    assert off.tis_capped_fraction == 0


def test_tis_is_exactly_one_when_the_sampler_is_the_training_pass():
    logp, inputs = tis_inputs(torch.zeros(2, 2))
    on = grpo.policy_loss(logp, inputs, grpo.LossSettings(tis_cap=2.0))
    plain = grpo.policy_loss(logp, inputs._replace(sampler_logp=None), grpo.LossSettings())
    assert torch.equal(on.loss, plain.loss)
    assert on.mismatch_kl == 0 and on.tis_weight_mean == 1 and on.tis_capped_fraction == 0


def test_the_mismatch_modes_bound_token_or_sequence_ratios_by_truncation_or_masking():
    # token ratios exp(old - sampler) = 2, 5, 1/2 (row 1's second token is padding); row ratios 10, 1/2
    sampler = torch.tensor([[-math.log(2), -math.log(5)], [math.log(2), 50.0]])
    cases = {  # mode, cap, floor -> weights (padding 1), tokens whose weight a bound changed
        ("token_truncate", 3.0, 0.6): ([[2.0, 3.0], [0.6, 1.0]], [[False, True], [True, False]]),
        ("token_mask", 3.0, 0.6): ([[2.0, 0.0], [0.0, 1.0]], [[False, True], [True, False]]),  # IcePop
        ("token_mask", None, 0.6): ([[2.0, 5.0], [0.0, 1.0]], [[False, False], [True, False]]),
        ("sequence_truncate", 3.0, None): ([[3.0, 3.0], [0.5, 1.0]], [[True, True], [False, False]]),
        ("sequence_mask", 3.0, None): ([[0.0, 0.0], [0.5, 1.0]], [[True, True], [False, False]]),  # MIS
    }
    for (mode, cap, floor), (weights, bound) in cases.items():
        settings = grpo.LossSettings(tis_cap=cap, tis_floor=floor, tis_mode=mode)
        weight, changed = grpo.tis_weights(torch.zeros(2, 2), sampler, TIS_MASK, settings)
        assert_close(weight, torch.tensor(weights)), mode
        assert changed.tolist() == bound, mode


def test_sequence_masking_drops_a_far_rows_surrogate_and_counts_it():
    sampler = torch.tensor([[-math.log(2), -math.log(5)], [math.log(2), 0.0]])
    logp, inputs = tis_inputs(sampler)
    out = grpo.policy_loss(logp, inputs, grpo.LossSettings(aggregation="token", tis_cap=3.0, tis_mode="sequence_mask"))
    # row 0's ratio 10 > 3: both its tokens weigh 0; row 1 (A = -2) weighs 1/2: -0.5 * -2 = 1; token mean 1/3
    assert_close(out.loss, scalar(1.0 / 3.0))
    assert_close(out.tis_capped_fraction, scalar(2.0 / 3.0))
    assert_close(out.tis_weight_mean, scalar(0.5 / 3.0))


def test_off_policy_sequence_masking_drops_negative_rows_that_drifted_from_the_sampler():
    """DeepSeek-V3.2: a row is dropped when A < 0 and the mean of sampler - policy over its tokens
    exceeds delta. Row 0 (A = +1) is kept whatever its drift; row 1 (A = -2) drifted by ln 2 = 0.69."""
    sampler = torch.tensor([[-math.log(2), -math.log(5)], [math.log(2), 0.0]])
    logp, inputs = tis_inputs(sampler)
    dropped = grpo.policy_loss(logp, inputs, grpo.LossSettings(aggregation="token", off_policy_mask=0.5))
    assert_close(dropped.loss, scalar(-2.0 / 3.0))  # row 0: -1, -1; row 1 dropped: 0; over 3 tokens
    assert_close(dropped.off_policy_masked_fraction, scalar(0.5))
    kept = grpo.policy_loss(logp, inputs, grpo.LossSettings(aggregation="token", off_policy_mask=0.7))
    assert_close(kept.loss, scalar(0.0))  # ln 2 < 0.7: kept; -1 - 1 + 2 = 0
    assert kept.off_policy_masked_fraction == 0


def test_mismatch_settings_out_of_range_are_rejected():
    logp, inputs = tis_inputs(torch.zeros(2, 2))
    for bad in (grpo.LossSettings(tis_floor=1.5), grpo.LossSettings(tis_floor=0.0),
                grpo.LossSettings(tis_mode="sequence"), grpo.LossSettings(off_policy_mask=0.0)):
        with pytest.raises(ValueError):
            grpo.policy_loss(logp, inputs, bad)


def test_tis_cap_below_one_is_rejected():
    logp, inputs = tis_inputs(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="tis_cap"):
        grpo.policy_loss(logp, inputs, grpo.LossSettings(tis_cap=0.5))


# ---------------------------------------------------------------- CISPO, GMPO, high-entropy tokens

def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient():
    # ratios e^0.5 = 1.65 (clipped to 1.28) and e^-0.5 = 0.61 (no lower bound with eps_low = 1); A = +1, -2
    logp = torch.tensor([[0.5], [-0.5]], requires_grad=True)
    inputs = grpo.LossInputs(torch.zeros(2, 1), torch.tensor([1.0, -2.0]), torch.ones(2, 1))
    out = grpo.policy_loss(logp, inputs, grpo.LossSettings(surrogate="cispo", eps_low=1.0, eps_high=0.28,
                                                           aggregation="token"))
    w = math.exp(-0.5)
    # l = -sg[clip(w)] A logp: -(1.28 * 1 * 0.5) and -(0.61 * -2 * -0.5) = -0.64, -0.61; token mean
    assert_close(out.loss, scalar((-0.64 - w) / 2))
    out.loss.backward()
    assert_close(logp.grad, torch.tensor([[-1.28], [2 * w]]) / 2)  # neither token's gradient is removed
    assert_close(out.clip_fraction, scalar(0.5))  # the first one's weight was capped
    assert_close(out.clip_high_fraction, scalar(0.5))


def test_cispo_on_policy_is_reinforce():
    logp = torch.tensor([[-0.3, -1.2]], requires_grad=True)
    inputs = grpo.LossInputs(logp.detach(), torch.tensor([2.0]), torch.ones(1, 2))
    out = grpo.policy_loss(logp, inputs, grpo.LossSettings(surrogate="cispo", aggregation="token"))
    out.loss.backward()
    assert_close(logp.grad, torch.tensor([[-1.0, -1.0]]))  # -A / 2 tokens each
    assert_close(out.loss, scalar(-2.0 * (-0.3 - 1.2) / 2))


def test_gmpo_is_the_geometric_mean_of_clipped_token_ratios():
    # row 0 (A = 1): log-ratios 0.2 and 0.6; 0.6 is clipped to 0.4 (A > 0: a ratio too high is cut, as
    # in PPO); rho = exp((0.2 + 0.4) / 2) = e^0.3. Row 1 (A = -1): -0.6 is clipped to -0.4 (A < 0: a
    # ratio too low is cut), 0.1 stays; rho = exp((-0.4 + 0.1) / 2) = e^-0.15.
    logp = torch.tensor([[0.2, 0.6], [-0.6, 0.1]], requires_grad=True)
    inputs = grpo.LossInputs(torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.ones(2, 2))
    out = grpo.policy_loss(logp, inputs, grpo.LossSettings(surrogate="gmpo", eps_low=0.4, eps_high=0.4))
    rho0, rho1 = math.exp(0.3), math.exp(-0.15)
    assert_close(out.loss, scalar((-rho0 + rho1) / 2))  # sequence aggregation: the mean of -A rho
    out.loss.backward()
    # d(-A rho)/d logp_t = -A rho / |y| where the token is not clipped, 0 where it is; / 2 rows
    assert_close(logp.grad, torch.tensor([[-rho0 / 2, 0.0], [0.0, rho1 / 2]]) / 2)
    assert_close(out.clip_high_fraction, scalar(0.25))
    assert_close(out.clip_low_fraction, scalar(0.25))
    # with every ratio 1 (one update per batch) it is REINFORCE on the mean log-prob: -A / |y| per token
    fresh = torch.tensor([[0.2, 0.6], [-0.6, 0.1]], requires_grad=True)
    grpo.policy_loss(fresh, grpo.LossInputs(fresh.detach(), torch.tensor([1.0, -1.0]), torch.ones(2, 2)),
                     grpo.LossSettings(surrogate="gmpo", eps_low=0.4, eps_high=0.4)).loss.backward()
    assert_close(fresh.grad, torch.tensor([[-0.25, -0.25], [0.25, 0.25]]))


def test_gmpo_and_cispo_need_token_ratios_and_no_dual_clip():
    logp, old, mask = one_token(0.0)
    inputs = grpo.LossInputs(old, torch.tensor([1.0]), mask)
    for bad in (grpo.LossSettings(surrogate="gmpo", ratio_level="sequence"),
                grpo.LossSettings(surrogate="cispo", dual_clip=3.0), grpo.LossSettings(surrogate="ppo")):
        with pytest.raises(ValueError):
            grpo.policy_loss(logp, inputs, bad)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_sapo_gates_the_ratio_softly_by_the_sign_of_the_advantage():
    # row 0: w = 1.5, A = +1, tau_pos = 1: l = -(4/1) sigmoid(0.5) * 1 = -2.48984
    # row 1: w = 0.5, A = -1, tau_neg = 1.05: l = -(4/1.05) sigmoid(-0.525) * -1 = +1.41595
    logp = torch.tensor([[math.log(1.5)], [math.log(0.5)]], requires_grad=True)
    inputs = grpo.LossInputs(torch.zeros(2, 1), torch.tensor([1.0, -1.0]), torch.ones(2, 1))
    out = grpo.policy_loss(logp, inputs, grpo.LossSettings(surrogate="sapo", aggregation="token"))
    s0, s1 = sigmoid(0.5), sigmoid(1.05 * -0.5)  # 0.622459, 0.371686
    assert_close(out.loss, scalar((-4 * s0 + 4 / 1.05 * s1) / 2))
    out.loss.backward()
    # d l / d logp = -A * 4 s (1 - s) * w (the gate's slope, times dw/dlogp = w); token mean over 2
    assert_close(logp.grad, torch.tensor([[-4 * s0 * (1 - s0) * 1.5], [4 * s1 * (1 - s1) * 0.5]]) / 2)
    assert_close(out.clip_fraction, scalar(0.0))  # both gates above 1/2: |tau (w - 1)| <= 1.76


def test_sapo_on_policy_is_reinforce_and_far_off_policy_tokens_fade():
    logp = torch.tensor([[-0.3, -1.2]], requires_grad=True)
    out = grpo.policy_loss(logp, grpo.LossInputs(logp.detach(), torch.tensor([2.0]), torch.ones(1, 2)),
                           grpo.LossSettings(surrogate="sapo", aggregation="token"))
    out.loss.backward()
    assert_close(logp.grad, torch.tensor([[-1.0, -1.0]]))  # 4 s (1 - s) = 1 at w = 1: -A / 2 tokens
    assert_close(out.loss, scalar(-2.0 * 2.0))  # -(4/tau) * 1/2 * A on each token
    # w = 4 (|tau (w - 1)| = 3 > 1.76): the gradient fades to 4 s (1 - s) w = 0.18 of REINFORCE's
    far = torch.tensor([[math.log(4.0)]], requires_grad=True)
    out = grpo.policy_loss(far, grpo.LossInputs(torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1)),
                           grpo.LossSettings(surrogate="sapo"))
    out.loss.backward()
    s = sigmoid(3.0)
    assert_close(far.grad, torch.tensor([[-4 * s * (1 - s) * 4.0]]))  # not 0, as the clip would give
    assert_close(out.clip_high_fraction, scalar(1.0))  # its gate weight 4 s (1 - s) = 0.18 < 1/2


def test_sapo_refuses_temperatures_that_are_not_positive():
    logp, old, mask = one_token(0.0)
    with pytest.raises(ValueError, match="sapo_tau"):
        grpo.policy_loss(logp, grpo.LossInputs(old, torch.tensor([1.0]), mask),
                         grpo.LossSettings(surrogate="sapo", sapo_tau=(1.0, 0.0)))


def test_high_entropy_mask_keeps_the_top_share_of_valid_tokens():
    entropy = torch.tensor([[0.1, 2.0, 0.5, 9.0], [1.5, 0.2, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # 9.0 is padding: never counted or kept
    # 7 valid tokens, share 0.3 -> ceil(2.1) = 3 kept: 3.0, 2.0, 1.5
    kept = grpo.high_entropy_mask(entropy, mask, 0.3)
    assert kept.tolist() == [[False, True, False, False], [True, False, True, False]]
    assert torch.equal(grpo.high_entropy_mask(entropy, mask, 1.0), mask.bool())
    assert grpo.high_entropy_mask(entropy, torch.zeros(2, 4), 0.2).sum() == 0


# ---------------------------------------------------------------- on-policy distillation

def two_tokens_distilled():
    """One row of 2 sampled tokens and a padded row: student log-probs, teacher log-probs, mask."""
    student = torch.tensor([[-0.5, -2.0], [-1.0, -9.0]])
    teacher = torch.tensor([[-1.0, -0.5], [-1.0, NAN]])  # padding may hold anything
    return student, teacher, torch.tensor([[1.0, 1.0], [1.0, 0.0]])


def test_distill_advantage_is_minus_weight_times_student_minus_teacher_beside_the_task():
    student, teacher, mask = two_tokens_distilled()
    # row 0: reverse KL per token = student - teacher = [0.5, -1.5]; weight 0.5 -> [-0.25, +0.75];
    # kept beside the task's advantage 0.3: [0.05, 1.05]. Row 1: KL 0 on its one token -> -0.2; pad 0.
    out = grpo.distill_advantages(torch.tensor([0.3, -0.2]), student, teacher, mask, grpo.DistillSettings(0.5, "keep"))
    assert_close(out, torch.tensor([[0.05, 1.05], [-0.2, 0.0]]))
    dropped = grpo.distill_advantages(torch.tensor([0.3, -0.2]), student, teacher, mask, grpo.DistillSettings(0.5, "drop"))
    assert_close(dropped, torch.tensor([[-0.25, 0.75], [0.0, 0.0]]))
    # mean reverse KL over the 3 valid tokens: (0.5 - 1.5 + 0) / 3
    assert_close(grpo.teacher_kl(student, teacher, mask), scalar(-1.0 / 3))


def test_distill_advantages_drive_the_one_loss_token_by_token():
    student, teacher, mask = two_tokens_distilled()
    adv = grpo.distill_advantages(torch.tensor([0.3, -0.2]), student, teacher, mask, grpo.DistillSettings(0.5, "keep"))
    logp = student.clone().requires_grad_(True)
    out = grpo.policy_loss(logp, grpo.LossInputs(logp.detach(), adv, mask),
                           grpo.LossSettings(aggregation="token"))
    out.loss.backward()
    # on-policy: loss = -(1/3) sum_t A_t w_t, so d loss / d logp_t = -A_t / 3 on the valid tokens
    assert_close(logp.grad, torch.tensor([[-0.05 / 3, -1.05 / 3], [0.2 / 3, 0.0]]))


def test_a_student_distilled_from_itself_gets_exactly_zero_signal():
    student, _, mask = two_tokens_distilled()
    same = student.clone()
    assert_close(grpo.teacher_kl(student, same, mask), scalar(0.0), rtol=0, atol=0)
    alone = grpo.distill_advantages(torch.zeros(2), student, same, mask, grpo.DistillSettings(2.0, "drop"))
    assert torch.equal(alone, torch.zeros(2, 2))
    beside = grpo.distill_advantages(torch.tensor([0.3, -0.2]), student, same, mask, grpo.DistillSettings(2.0, "keep"))
    assert torch.equal(beside, torch.tensor([[0.3, 0.3], [-0.2, 0.0]]))  # the task's advantages, unchanged
    logp = student.clone().requires_grad_(True)
    grpo.policy_loss(logp, grpo.LossInputs(logp.detach(), alone, mask)).loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 2))


def test_per_token_advantages_are_summarised_over_the_loss_tokens_and_merged():
    student, teacher, mask = two_tokens_distilled()
    adv = grpo.distill_advantages(torch.tensor([0.3, -0.2]), student, teacher, mask, grpo.DistillSettings(0.5, "keep"))
    # the valid tokens' advantages [0.05, 1.05, -0.2] (the padding's 0 not among them): n 3, sum 0.9,
    # squares 0.0025 + 1.1025 + 0.04 = 1.145, |.| 1.3, min -0.2, max 1.05
    summary = grpo.token_summary(adv, mask)
    assert_close(summary, torch.tensor([3.0, 0.9, 1.145, 1.3, -0.2, 1.05]))
    # split into two micro-batches of one row each, then merged: the same
    merged = grpo.merge_summaries(torch.stack([grpo.token_summary(adv[:1], mask[:1]),
                                               grpo.token_summary(adv[1:], mask[1:])]))
    assert_close(merged, summary)
    stats = grpo.summary_statistics(merged)
    # mean 0.3; sample variance (1.145 - 0.9**2 / 3) / 2 = 0.4375, std 0.661438; |.| mean 1.3 / 3
    assert stats == pytest.approx({"mean": 0.3, "abs_mean": 1.3 / 3, "std": 0.4375 ** 0.5, "min": -0.2, "max": 1.05},
                                  rel=1e-6)
    assert stats["std"] == pytest.approx(float(torch.tensor([0.05, 1.05, -0.2]).std()), rel=1e-6)  # torch.std's n - 1
    nothing = grpo.token_summary(adv, torch.zeros_like(mask))
    assert_close(grpo.merge_summaries(torch.stack([nothing, summary])), summary)  # an empty micro-batch changes nothing
    assert grpo.summary_statistics(nothing) == dict.fromkeys(("mean", "abs_mean", "std", "min", "max"), 0.0)


def test_distill_settings_out_of_range_are_rejected():
    student, teacher, mask = two_tokens_distilled()
    with pytest.raises(ValueError, match="keep' or 'drop"):
        grpo.distill_advantages(torch.zeros(2), student, teacher, mask, grpo.DistillSettings(1.0, "both"))
    with pytest.raises(ValueError, match="weight must be >= 0"):
        grpo.distill_advantages(torch.zeros(2), student, teacher, mask, grpo.DistillSettings(-1.0))
