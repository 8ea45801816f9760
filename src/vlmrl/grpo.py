"""GRPO and its variants as pure tensor math: advantages, KL estimators, one clipped loss.

No model, no IO, no config: the trainer hands in log-probabilities and rewards, and gets back a
scalar loss and a few detached statistics. Every variant is a setting of the same knobs.

The objective. For a prompt, sample a group of G completions y_1..y_G and score them with rewards
r_i. Each completion's advantage compares it with its own group:

    A_i = (r_i - mean_j r_j) / (std_j r_j + eps)      scale="group"  (GRPO, DAPO, GSPO)
    A_i = (r_i - mean_j r_j) / (std_batch + eps)      scale="batch"  (one scale for the whole batch)
    A_i =  r_i - mean_j r_j                           scale="none"   (Dr. GRPO)

The group std is the population std of the group (divide by G, `unbiased=False`): the G
completions are the whole group, and z-scores then have a root-mean-square of exactly 1. TRL's
GRPOTrainer uses the sample std (divide by G - 1); its advantages are ours times sqrt((G - 1) / G).
std_batch is the sample std of every group-centred reward in the batch (all processes': the
trainer passes the whole batch). Optional shaping then cubes them (`shape_advantages`).

With per-token log-probs logp_t of the policy being trained and old_t of the policy that sampled,
the importance ratio is either per token or per sequence (GSPO, length-normalised):

    ratio_level="token":     w_t = exp(logp_t - old_t)
    ratio_level="sequence":  s   = exp( (1/|y|) sum_t (logp_t - old_t) )
                             w_t = sg[s] * exp(logp_t - sg[logp_t])   (value s, gradient per token)

and the per-token loss is a surrogate plus an optional KL penalty to a reference model. The
surrogate is PPO's clipped one (`surrogate="clip"`, GRPO and its variants), or one of two others:

    clip:   l_t = -min(w_t A, clip(w_t, 1 - eps_low, 1 + eps_high) A)            + beta * KL_t
    cispo:  l_t = -sg[clip(w_t, 1 - eps_low, 1 + eps_high)] A logp_t              + beta * KL_t
    gmpo:   l_t = -A exp( (1/|y|) sum_s sgn(A) min(sgn(A) d_s, sgn(A) clip(d_s, -eps_low, eps_high)) )
                                                                                  + beta * KL_t
            with d_s = logp_s - old_s: the same value on every token of a row
    sapo:   l_t = -(4 / tau) sigmoid(tau (w_t - 1)) A                               + beta * KL_t
            tau = tau_pos where A > 0, else tau_neg

CISPO (MiniMax-M1) clips the importance weight, never the gradient: every token keeps its
gradient, scaled by the clipped weight (its preset sets eps_low = 1, no lower bound). GMPO
(geometric-mean policy optimization) maximises the geometric mean of the token ratios, each
clipped in log space to [-eps_low, eps_high] (its preset: 0.4 both), a sequence-level objective
whose gradient per token is A rho / |y|. Both need per-token ratios (`ratio_level="token"`).
SAPO (soft adaptive policy optimization, Gao et al. 2025, arXiv 2511.20347; TRL's `loss_type="sapo"`
and verl's "sapo" compute the same) replaces the hard clip by a smooth gate: the gradient on token t
is -A 4 s (1 - s) grad(w_t) with s = sigmoid(tau (w_t - 1)), exactly the clip-free gradient at w = 1
(4 s (1 - s) = 1 there) and decaying smoothly as w leaves 1, instead of dropping to 0 at a bound;
tau_neg > tau_pos (1.05 / 1.0, the paper's and TRL's defaults) damps negative-advantage tokens a little
faster. Works at either ratio level; its "clip" statistics count the tokens whose gate weight
4 s (1 - s) fell below 1/2 (|w - 1| > 1.76 / tau), below or above 1.
`high_entropy_mask` keeps only the highest-entropy share of tokens in the loss ("80/20": the
forking tokens, `top_entropy_share=0.2`).

The per-token losses are reduced to a scalar by `aggregate`: mean over all tokens of the batch ("token"), mean per
sequence then over sequences ("sequence"), or sum divided by B * max_len ("constant").

Rollout/training mismatch. The sampler's log-probs samp_t (recorded during generation) can differ
from old_t, the training forward's log-probs of the same policy (another kernel, bf16, a compiled
decode step). Importance sampling against it reweights each token's surrogate by a constant c_t
(no gradient), l_t = -c_t * min(w_t A, clip(w_t) A) + beta * KL_t, from the ratio
rho_t = exp(old_t - samp_t) per token or rho = exp(sum_t (old_t - samp_t)) per sequence
(`tis_mode`; bounds C_max = `tis_cap`, C_min = `tis_floor`):

    token_truncate     c_t = clip(rho_t, C_min, C_max)            TIS (vlmrl's default, verl's token TIS)
    token_mask         c_t = rho_t, 0 outside [C_min, C_max]      IcePop's two-sided token masking
    sequence_truncate  c_t = clip(rho, C_min, C_max)              on every token of the row
    sequence_mask      c_t = rho, 0 outside [C_min, C_max]        MIS (TRL's default since 2026)

A missing bound is open (truncation with no floor keeps small weights). Off-policy sequence masking
(DeepSeek-V3.2, eq. 9; TRL's `off_policy_mask_threshold`) drops the rows that both have A < 0 and
have drifted from the sampler: (1/|y|) sum_t (samp_t - logp_t) > delta (`off_policy_mask`), with
logp the policy being trained (detached): negative updates from samples the policy no longer
produces are the ones that destabilise. The mismatch itself is logged as KL(sampler || training)
estimated with k3 from the sampled tokens, with the share of tokens whose weight a bound changed
(`tis_capped_fraction`: clipped or masked) and the share of rows the off-policy mask dropped.

    preset    advantages         eps_low / eps_high  ratio     aggregation  KL         extras
    --------  -----------------  ------------------  --------  -----------  ---------  ---------------------------
    GRPO      z-score ("group")  0.2 / 0.2           token     sequence     beta>0 k3  -
    DAPO      z-score ("group")  0.2 / 0.28          token     token        beta=0     dynamic sampling, overlong
                                                                                       shaping (penalty / filter)
    Dr. GRPO  r - mean ("none")  0.2 / 0.2           token     constant     beta=0     divide by max_new_tokens
    GSPO      z-score ("group")  3e-4 / 4e-4         sequence  sequence     beta=0     -
    CISPO     z-score ("group")  1.0 / 0.28          token     token        beta=0     surrogate="cispo"
    GMPO      z-score ("group")  0.4 / 0.4 (log)     token     sequence     beta=0     surrogate="gmpo"
    SAPO      z-score ("group")  - (tau 1.0 / 1.05)  token     sequence     beta=0     surrogate="sapo"
    80/20     any                any                 any       any          any        top_entropy_share=0.2
    cubic     any, then A**3     any                 any       any          any        `shape_advantages`

On-policy distillation (`distill_advantages`). The student (the policy) samples; a frozen teacher
scores each sampled token; the per-token reverse KL estimate on the student's own sample,
k_t = logp_t - teacher_t (its expectation over y_t ~ pi_student is KL(pi_student || pi_teacher) at
that prefix), is the signal, as a per-token advantage with no gradient through it:

    A_t = A_task - lambda * (old_t - teacher_t)     distill_reward="keep": beside the task's reward
    A_t =        - lambda * (old_t - teacher_t)     distill_reward="drop": distillation alone

with old_t the student's log-probs of the batch before the updates (the training forward's, as
the teacher's come from the same scorer, so a student distilled from a copy of itself gets exactly
0) and lambda = `distill_weight`. This is Thinking Machines' on-policy distillation (Lu et al.,
"On-Policy Distillation", 2025; tinker-cookbook `distillation/train_on_policy.py`,
`incorporate_kl_penalty`: the negative reverse KL times `kl_penalty_coef`, added to the advantages
after they are normalised, no discount), the form verl, slime, prime-rl and ROLL ship as a "teacher
KL" advantage; TRL's GKD (Agarwal et al. 2024, arXiv 2306.13649) takes the full-vocabulary
generalised JSD instead, which needs both models' logits at once: not done here. The surrogate (clip,
TIS, aggregation) then treats A_t as any per-token advantage; the mean of k_t over the loss's tokens
is logged as `distill/teacher_kl` (`teacher_kl`).

When old_logp == logp.detach() (one optimizer step per batch, the common case) every ratio is 1,
nothing is clipped, and the gradient is the REINFORCE gradient -A * grad(logp_t) / normaliser.

Shapes: N rollouts = B rows of the loss; T completion tokens (right-padded, `mask` marks the real
ones). Rewards and advantages are laid out group-contiguous: prompt 0's G completions, then
prompt 1's, and so on.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

AdvantageScale = Literal["group", "batch", "none"]
Shaping = Literal["none", "cubic", "cubic_rescaled"]
Aggregation = Literal["token", "sequence", "constant"]
RatioLevel = Literal["token", "sequence"]
Surrogate = Literal["clip", "cispo", "gmpo", "sapo"]
KLKind = Literal["k1", "k2", "k3"]
TisMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
DistillReward = Literal["keep", "drop"]

LOG_RATIO_CLAMP = 20.0
"""KL estimators clamp log(ref / policy) to [-20, 20]: exp(20) ~ 5e8 is finite in fp16/bf16/fp32,
and a token that far from the reference is a bug to be seen in the stats, not a NaN."""


class LossOutput(NamedTuple):
    """What `policy_loss` returns: the loss to backpropagate and detached statistics."""

    loss: Tensor
    """Scalar, differentiable w.r.t. logp: aggregate(pg + beta * kl)."""
    pg_loss: Tensor
    """Scalar, detached: aggregate(pg), the surrogate alone (TIS-weighted when on)."""
    kl: Tensor
    """Scalar, detached: mean KL estimate over valid tokens (0 when no ref_logp)."""
    clip_fraction: Tensor
    """Scalar, detached: fraction of counted tokens at a clip bound, as the surrogate defines it
    (`policy_loss`: the clip's removed gradients, CISPO's capped weights, GMPO's clipped log-ratios)."""
    clip_low_fraction: Tensor
    """Scalar, detached: the part of clip_fraction at the lower bound (under "clip": A < 0 and
    w < 1 - eps_low)."""
    clip_high_fraction: Tensor
    """Scalar, detached: the part of clip_fraction at the upper bound (under "clip": A > 0 and
    w > 1 + eps_high, with dual_clip also A < 0 and w > c)."""
    ratio_mean: Tensor
    """Scalar, detached: mean importance ratio over valid tokens."""
    mismatch_kl: Tensor
    """Scalar, detached: mean k3 estimate of KL(sampler || training) over valid tokens (0 without
    sampler log-probs)."""
    tis_weight_mean: Tensor
    """Scalar, detached: mean TIS weight c_t over valid tokens (1 when off; 0 on an empty mask)."""
    tis_capped_fraction: Tensor
    """Scalar, detached: fraction of valid tokens whose importance weight a bound changed (clipped
    under *_truncate, zeroed under *_mask)."""
    off_policy_masked_fraction: Tensor
    """Scalar, detached: fraction of rows the off-policy sequence mask dropped (0 when off)."""


def _check_groups(n: int, group_size: int) -> int:
    """Number of groups; ValueError unless n is a positive multiple of group_size."""
    if group_size < 1 or n % group_size != 0:
        raise ValueError(f"{n} rewards cannot be split into groups of {group_size}: "
                         "the number of rewards must be a multiple of group_size >= 1")
    return n // group_size


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` where `mask` is true (over everything, or along `dim`); 0 where empty.

    Positions outside the mask are never read, so inf or NaN padding cannot leak in.
    """
    valid = mask.bool()  # same shape as values
    total = torch.where(valid, values, torch.zeros_like(values))  # same shape as values
    if dim is None:
        return total.sum() / valid.sum().clamp(min=1)  # ()
    return total.sum(dim) / valid.sum(dim).clamp(min=1)  # values.shape without dim


def group_advantages(rewards: Tensor, group_size: int, *, scale: AdvantageScale = "group",
                     eps: float = 1e-6) -> Tensor:
    """(N,) advantages from (N,) group-contiguous rewards: r - group mean, divided by the group's
    population std ("group"), by the sample std of all the centred rewards ("batch"), or by
    nothing ("none"). A group whose rewards are all equal gets advantage 0 exactly, under any scale.
    """
    num_groups = _check_groups(rewards.numel(), group_size)
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none'; got {scale!r}")
    grouped = rewards.float().reshape(num_groups, group_size)  # (N/G, G)
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # (N/G, G)
    if scale == "group":
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)  # (N/G, G)
    elif scale == "batch":
        centred = centred / (centred.std() + eps)  # (N/G, G)
    return centred.reshape(-1)  # (N,)


def combine_rewards(components: Tensor, weights: Tensor, group_size: int, *,
                    aggregation: str = "sum", eps: float = 1e-6) -> Tensor:
    """(N,) one reward from (K, N) reward components (NaN: the reward does not apply) and (K,) weights.

    "sum": sum of weight * component, a NaN counting 0. "normalize_then_sum" (GDPO): each component
    first z-scored within each group over the completions it applies to (population std; a group
    whose values are all equal gives 0), then the weighted sum, NaN counting 0.
    """
    if aggregation not in ("sum", "normalize_then_sum"):
        raise ValueError(f"aggregation must be 'sum' or 'normalize_then_sum'; got {aggregation!r}")
    values = components.float()  # (K, N)
    if aggregation == "normalize_then_sum":
        num_groups = _check_groups(values.shape[1], group_size)
        grouped = values.reshape(values.shape[0], num_groups, group_size)  # (K, N/G, G)
        present = ~torch.isnan(grouped)  # (K, N/G, G)
        count = present.sum(dim=2, keepdim=True).clamp(min=1)  # (K, N/G, 1)
        filled = torch.where(present, grouped, torch.zeros_like(grouped))  # (K, N/G, G)
        mean = filled.sum(dim=2, keepdim=True) / count  # (K, N/G, 1)
        centred = torch.where(present, grouped - mean, torch.zeros_like(grouped))  # (K, N/G, G)
        std = (centred.pow(2).sum(dim=2, keepdim=True) / count).sqrt()  # (K, N/G, 1)
        normalized = torch.where(present, centred / (std + eps), torch.full_like(grouped, float("nan")))
        values = normalized.reshape(values.shape)  # (K, N)
    return (torch.nan_to_num(values, nan=0.0) * weights.float()[:, None]).sum(dim=0)  # (N,)


def advantage_alignment(components: Tensor, advantages: Tensor, group_size: int) -> Tensor:
    """(K, 2) for each of K reward components (K, N): the sum, over the groups of `group_size`
    contiguous rows whose advantages (N,) are not all equal, of the group's correlation between the
    advantages and that component, and the number of those groups. Summable over processes; their
    ratio is the mean within-group correlation: 1 when the advantage ranks every group's
    completions exactly as that part does, 0 when the part is constant within each group (it
    drives nothing), negative when it pulls against the advantage. A NaN (the reward does not
    apply) counts as its group's mean."""
    num_groups = _check_groups(advantages.numel(), group_size)
    adv = advantages.detach().float().reshape(num_groups, group_size)  # (N/G, G)
    adv = adv - adv.mean(dim=1, keepdim=True)  # (N/G, G) shaped advantages need not be centred
    values = components.detach().float().reshape(components.shape[0], num_groups, group_size)  # (K, N/G, G)
    present = ~torch.isnan(values)  # (K, N/G, G)
    filled = torch.where(present, values, torch.zeros_like(values))  # (K, N/G, G)
    mean = filled.sum(dim=2, keepdim=True) / present.sum(dim=2, keepdim=True).clamp(min=1)  # (K, N/G, 1)
    centred = torch.where(present, values - mean, torch.zeros_like(values))  # (K, N/G, G)
    adv_norm = adv.square().sum(dim=1).sqrt()  # (N/G,)
    part_norm = centred.square().sum(dim=2).sqrt()  # (K, N/G)
    signal = adv_norm > 1e-6  # (N/G,) groups whose advantages differ
    cross = (centred * adv).sum(dim=2)  # (K, N/G)
    correlation = torch.where(part_norm > 1e-6, cross / (part_norm * adv_norm).clamp(min=1e-12),
                              torch.zeros_like(cross))  # (K, N/G)
    correlation = torch.where(signal, correlation, torch.zeros_like(correlation))  # (K, N/G)
    return torch.stack([correlation.sum(dim=1), signal.sum().float().expand(len(values))], dim=1)  # (K, 2)


def cubic_shaping(advantages: Tensor, *, group_size: int | None = None) -> Tensor:
    """Cubic advantage shaping: A' = A**3, sign kept; outliers of a group weigh more.

    A lone success among failures (large |A|) is pushed harder than the many ordinary ones
    (|A| < 1 shrinks, |A| > 1 grows). With `group_size`, each group of A' is rescaled so that
    its root-mean-square equals that of the group's A (so the overall step size is unchanged);
    groups of zeros stay zeros.
    """
    cubed = advantages ** 3  # same shape as advantages
    if group_size is None:
        return cubed
    num_groups = _check_groups(advantages.numel(), group_size)
    before = advantages.reshape(num_groups, group_size)  # (N/G, G)
    after = cubed.reshape(num_groups, group_size)  # (N/G, G)
    rms_before = before.pow(2).mean(dim=1, keepdim=True).sqrt()  # (N/G, 1)
    rms_after = after.pow(2).mean(dim=1, keepdim=True).sqrt()  # (N/G, 1)
    scaled = after * rms_before / rms_after.clamp(min=torch.finfo(after.dtype).tiny)  # (N/G, G)
    return scaled.reshape(advantages.shape)  # (N,)


def shape_advantages(advantages: Tensor, group_size: int, shaping: Shaping = "none") -> Tensor:
    """(N,) advantages after optional shaping: "none" leaves them, "cubic" cubes them
    (`cubic_shaping`), "cubic_rescaled" cubes them and rescales each group to its former rms."""
    if shaping == "none":
        return advantages
    if shaping == "cubic":
        return cubic_shaping(advantages)
    if shaping == "cubic_rescaled":
        return cubic_shaping(advantages, group_size=group_size)
    raise ValueError(f"shaping must be 'none', 'cubic' or 'cubic_rescaled'; got {shaping!r}")


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int,
                     penalty: float = 1.0) -> Tensor:
    """(N,) DAPO soft overlong punishment, added to the reward.

    0 up to max_new_tokens - buffer tokens, then linear down to -penalty at max_new_tokens
    (and beyond): -penalty * (len - (max_new_tokens - buffer)) / buffer, clamped to [-penalty, 0].
    buffer = 0 turns it off (all zeros).
    """
    if not 0 <= buffer <= max_new_tokens:
        raise ValueError(f"overlong buffer must be in [0, max_new_tokens={max_new_tokens}]; got {buffer}")
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)  # (N,)
    over = lengths.float() - (max_new_tokens - buffer)  # (N,) tokens into the buffer
    return (-penalty * over / buffer).clamp(min=-penalty, max=0.0)  # (N,)


def dynamic_sampling_mask(rewards: Tensor, group_size: int) -> Tensor:
    """(N/G,) bool: True for groups whose rewards are not all equal (DAPO keeps only these)."""
    num_groups = _check_groups(rewards.numel(), group_size)
    grouped = rewards.reshape(num_groups, group_size)  # (N/G, G)
    return grouped.max(dim=1).values != grouped.min(dim=1).values  # (N/G,)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: KLKind = "k3") -> Tensor:
    """(B, T) per-token estimate of KL(policy || reference) from samples of the policy.

    With d = ref_logp - logp clamped to [-20, 20] (see LOG_RATIO_CLAMP):
    k1 = -d (unbiased, can be negative); k2 = d**2 / 2 (biased, >= 0);
    k3 = exp(d) - d - 1 (Schulman's estimator: unbiased and >= 0; GRPO's choice), computed as
    expm1(d) - d: the naive form rounds to small negatives near d = 0 (-6e-8 in fp32, -4e-3 in bf16).
    """
    d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    if kind == "k1":
        return -d  # (B, T)
    if kind == "k2":
        return 0.5 * d * d  # (B, T)
    if kind == "k3":
        return torch.expm1(d) - d  # (B, T) = exp(d) - 1 - d; expm1 keeps it >= 0 near d = 0
    raise ValueError(f"kl kind must be 'k1', 'k2' or 'k3'; got {kind!r}")


def aggregate(values: Tensor, mask: Tensor, mode: Aggregation = "sequence",
              max_len: int | None = None) -> Tensor:
    """Scalar from (B, T) per-token values; only positions where mask is true count.

    "token":    sum(values) / number of valid tokens in the batch               (DAPO)
    "sequence": mean over the B rows of each row's token mean                   (GRPO)
                (a row with no valid token contributes 0 and still counts in B)
    "constant": sum(values) / (B * max_len)                                     (Dr. GRPO)
    Empty masks give 0, never NaN.
    """
    valid = mask.bool()  # (B, T)
    masked = torch.where(valid, values, torch.zeros_like(values))  # (B, T)
    rows = max(values.shape[0], 1)
    if mode == "token":
        return masked.sum() / valid.sum().clamp(min=1)  # ()
    if mode == "sequence":
        per_row = masked.sum(-1) / valid.sum(-1).clamp(min=1)  # (B,)
        return per_row.sum() / rows  # ()
    if mode == "constant":
        if max_len is None or max_len < 1:
            raise ValueError("aggregation 'constant' needs max_len >= 1 (the max_new_tokens of the rollout)")
        return masked.sum() / (rows * max_len)  # ()
    raise ValueError(f"aggregation must be 'token', 'sequence' or 'constant'; got {mode!r}")


class DistillSettings(NamedTuple):
    """The knobs of `distill_advantages`."""

    weight: float = 1.0
    """lambda >= 0: the weight of the teacher's per-token signal."""
    reward: DistillReward = "keep"
    """"keep" the task's advantages beside it, or "drop" them (distillation alone)."""


def distill_advantages(advantages: Tensor, student_logp: Tensor, teacher_logp: Tensor, mask: Tensor,
                       settings: DistillSettings = DistillSettings()) -> Tensor:
    """(B, T) per-token advantages of on-policy distillation (module doc): the task's advantages
    (B,) or (B, T), kept or dropped as `settings.reward` says, minus `settings.weight` times the
    reverse KL estimate student - teacher of each sampled token; 0 on padding. Every input is a
    constant here."""
    weight, reward = settings
    if reward not in ("keep", "drop"):
        raise ValueError(f"distill reward must be 'keep' or 'drop'; got {reward!r}")
    if not weight >= 0:
        raise ValueError(f"distill weight must be >= 0; got {weight}")
    valid = mask.bool()  # (B, T)
    task = advantages.detach().to(student_logp.dtype)
    task = task.unsqueeze(-1) if task.dim() == 1 else task  # (B, 1) or (B, T)
    reverse_kl = torch.where(valid, student_logp.detach() - teacher_logp.detach(),
                             torch.zeros_like(student_logp))  # (B, T)
    base = task.expand_as(reverse_kl) if reward == "keep" else torch.zeros_like(reverse_kl)  # (B, T)
    return torch.where(valid, base - weight * reverse_kl, torch.zeros_like(reverse_kl))  # (B, T)


def teacher_kl(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """() the mean over valid tokens of student - teacher log-probs of the sampled tokens: the
    reverse KL(student || teacher) estimated on the student's own samples (k1); 0 on an empty mask."""
    return masked_mean((student_logp - teacher_logp).detach(), mask)


def token_summary(values: Tensor, mask: Tensor) -> Tensor:
    """(6,) count, sum, sum of squares, sum of absolute values, min and max of `values` (B, T) over
    the tokens of `mask`: what per-token advantages are logged from, summable over micro-batches and
    processes (`merge_summaries`). An empty mask gives zeros with min +inf and max -inf."""
    valid = mask.bool()  # (B, T)
    picked = values.detach().float()[valid]  # (n,)
    if picked.numel() == 0:
        return torch.tensor([0.0, 0.0, 0.0, 0.0, math.inf, -math.inf], device=values.device)
    return torch.stack([torch.tensor(float(picked.numel()), device=values.device), picked.sum(),
                        picked.square().sum(), picked.abs().sum(), picked.min(), picked.max()])  # (6,)


def merge_summaries(summaries: Tensor) -> Tensor:
    """(6,) the `token_summary` of the union of the token sets summarised in `summaries` (K, 6)."""
    return torch.cat([summaries[:, :4].sum(0), summaries[:, 4:5].amin(0), summaries[:, 5:].amax(0)])  # (6,)


def summary_statistics(summary: Tensor) -> dict[str, float]:
    """The mean, mean absolute value, sample std (n - 1, as torch.std), min and max of a
    `token_summary`; all 0 without tokens (std 0 with one)."""
    count, total, squares, absolute, low, high = summary.tolist()
    if count == 0:
        return dict.fromkeys(("mean", "abs_mean", "std", "min", "max"), 0.0)
    variance = max(squares - total * total / count, 0.0) / max(count - 1, 1)
    return {"mean": total / count, "abs_mean": absolute / count, "std": math.sqrt(variance), "min": low, "max": high}


def importance_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor,
                     level: RatioLevel = "token") -> Tensor:
    """(B, T) importance ratios; padding positions are 1.

    "token":    exp(logp_t - old_t).
    "sequence": GSPO. Every token of a row has the value s = exp(mean_t (logp_t - old_t)) and the
                gradient of sg[s] * exp(logp_t - sg[logp_t]), i.e. d w_t / d logp_t = s.
    """
    valid = mask.bool()  # (B, T)
    log_ratio = torch.where(valid, logp - old_logp, torch.zeros_like(logp))  # (B, T)
    if level == "token":
        return torch.exp(log_ratio)  # (B, T)
    if level == "sequence":
        seq_log_ratio = log_ratio.sum(-1) / valid.sum(-1).clamp(min=1)  # (B,)
        log_w = seq_log_ratio.detach().unsqueeze(-1) + (logp - logp.detach())  # (B, T) value log s
        return torch.exp(torch.where(valid, log_w, torch.zeros_like(logp)))  # (B, T)
    raise ValueError(f"ratio_level must be 'token' or 'sequence'; got {level!r}")


class LossInputs(NamedTuple):
    """The constants of `policy_loss` for B rows of T completion tokens."""

    old_logp: Tensor
    """(B, T) log-probs under the policy that sampled (logp.detach() for one update per batch)."""
    advantages: Tensor
    """(B,) one per completion, or (B, T) one per token."""
    mask: Tensor
    """(B, T) 1/True on the completion tokens that count."""
    ref_logp: Tensor | None = None
    """(B, T) log-probs under the reference policy; needed when beta > 0."""
    sampler_logp: Tensor | None = None
    """(B, T) log-probs the sampler recorded for the sampled tokens; None = not recorded (no TIS)."""
    trained_mask: Tensor | None = None
    """(B, T) the tokens the loss and its clip statistics are taken over, within `mask` (the 80/20
    rule's high-entropy tokens); None = `mask`. The sampler mismatch, TIS and KL statistics are
    over all of `mask`."""

    def rows(self, index) -> LossInputs:
        """The rows `index` of every tensor (a micro-batch)."""
        return LossInputs(*(None if x is None else x[index] for x in self))


class LossSettings(NamedTuple):
    """The knobs of `policy_loss`; GRPO, DAPO, Dr. GRPO and GSPO are settings of these (see above)."""

    eps_low: float = 0.2
    """Lower clip range: ratio >= 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip range: ratio <= 1 + eps_high (DAPO: 0.28)."""
    ratio_level: RatioLevel = "token"
    """Importance ratio per token, or per sequence (GSPO)."""
    aggregation: Aggregation = "sequence"
    """How per-token losses become a scalar (`aggregate`)."""
    max_len: int | None = None
    """max_new_tokens of the rollout; needed by aggregation "constant"."""
    beta: float = 0.0
    """Weight of the KL penalty to the reference."""
    kl_kind: KLKind = "k3"
    """KL estimator (`kl_penalty`)."""
    dual_clip: float | None = None
    """c > 1 caps the loss of a negative-advantage token at c * |A| (dual-clip PPO; surrogate "clip"
    only); None = off."""
    surrogate: Surrogate = "clip"
    """The policy-gradient surrogate: PPO's clipped one, CISPO's or GMPO's (see the module doc)."""
    tis_cap: float | None = None
    """C_max >= 1 of the importance weights against the sampler (when its log-probs are given);
    None: no upper bound (with no tis_floor either: no correction)."""
    tis_floor: float | None = None
    """C_min in (0, 1] of the importance weights; None: no lower bound."""
    tis_mode: TisMode = "token_truncate"
    """How the weights are taken and bounded (see the module doc)."""
    off_policy_mask: float | None = None
    """delta > 0: drop the rows with A < 0 whose mean sampler - policy log-ratio exceeds it
    (DeepSeek-V3.2's off-policy sequence masking); None = off."""
    sapo_tau: tuple[float, float] = (1.0, 1.05)
    """SAPO's gate temperatures (tau_pos for A > 0, tau_neg otherwise), each > 0."""


TIS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def tis_weights(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, s: LossSettings) -> tuple[Tensor, Tensor]:
    """(B, T) importance weights of the training pass against the sampler, taken and bounded as
    s.tis_mode says within [s.tis_floor, s.tis_cap] (module doc), 1 on padding; and (B, T) bool
    where a bound changed the weight. Both inputs are constants here."""
    valid = mask.bool()  # (B, T)
    cap, floor = s.tis_cap, s.tis_floor
    log_w = torch.where(valid, old_logp - sampler_logp, torch.zeros_like(old_logp))  # (B, T)
    if s.tis_mode.startswith("sequence"):
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)  # (B, T) the row's ratio on each token
    weight = torch.exp(log_w)  # (B, T), may be inf or 0 before the bounds
    high = cap if cap is not None else math.inf
    low = floor if floor is not None else 0.0
    outside = valid & ((weight > high) | (weight < low))  # (B, T)
    if s.tis_mode.endswith("truncate"):
        return torch.where(valid, weight.clamp(min=low, max=high), torch.ones_like(weight)), outside
    return torch.where(outside, torch.zeros_like(weight), torch.where(valid, weight, torch.ones_like(weight))), outside


def off_policy_rows(logp: Tensor, sampler_logp: Tensor, adv: Tensor, mask: Tensor, delta: float) -> Tensor:
    """(B, 1) bool: the rows DeepSeek-V3.2's off-policy sequence mask drops, those with A < 0 whose
    mean log-ratio sampler / policy over their tokens exceeds `delta`."""
    valid = mask.bool()  # (B, T)
    drift = masked_mean(sampler_logp - logp.detach(), valid, dim=-1).unsqueeze(-1)  # (B, 1)
    row_adv = masked_mean(adv.expand_as(logp), valid, dim=-1).unsqueeze(-1)  # (B, 1)
    return (row_adv < 0) & (drift > delta)  # (B, 1)


class SurrogateTerms(NamedTuple):
    """A surrogate's per-token loss and what its clip did, all (B, T)."""

    pg: Tensor
    """The per-token policy-gradient loss (differentiable w.r.t. logp)."""
    ratio: Tensor
    """The importance ratio w_t (detached)."""
    clip_low: Tensor
    """bool: the lower clip bound (A < 0 under "clip" and "gmpo"; any A under "cispo")."""
    clip_high: Tensor
    """bool: the upper clip bound."""


def clipped_surrogate(logp: Tensor, old: Tensor, adv: Tensor, valid: Tensor, s: LossSettings) -> SurrogateTerms:
    """PPO's clipped surrogate -min(w A, clip(w) A) (+ dual clip); adv (B, 1) or (B, T)."""
    ratio = importance_ratio(logp, old, valid, s.ratio_level)  # (B, T)
    clipped = ratio.clamp(1.0 - s.eps_low, 1.0 + s.eps_high)  # (B, T)
    pg = torch.maximum(-ratio * adv, -clipped * adv)  # (B, T) = -min(w A, clip(w) A)
    clip_high = (adv > 0) & (ratio > 1.0 + s.eps_high)  # (B, T)
    clip_low = (adv < 0) & (ratio < 1.0 - s.eps_low)  # (B, T)
    if s.dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -s.dual_clip * adv), pg)  # (B, T)
        clip_high = clip_high | ((adv < 0) & (ratio > s.dual_clip))  # (B, T) the dual clip bounds from above
    return SurrogateTerms(pg, ratio.detach(), clip_low, clip_high)


def cispo_surrogate(logp: Tensor, old: Tensor, adv: Tensor, valid: Tensor, s: LossSettings) -> SurrogateTerms:
    """CISPO: -sg[clip(w, 1 - eps_low, 1 + eps_high)] A logp; every token keeps its gradient."""
    ratio = importance_ratio(logp, old, valid, "token").detach()  # (B, T)
    weight = ratio.clamp(1.0 - s.eps_low, 1.0 + s.eps_high)  # (B, T) a constant
    return SurrogateTerms(-weight * adv * logp, ratio, ratio < 1.0 - s.eps_low, ratio > 1.0 + s.eps_high)


def gmpo_surrogate(logp: Tensor, old: Tensor, adv: Tensor, valid: Tensor, s: LossSettings) -> SurrogateTerms:
    """GMPO: -A rho with rho = exp(row mean of the sign-aware clipped log-ratios), on every token."""
    log_ratio = torch.where(valid, logp - old, torch.zeros_like(logp))  # (B, T)
    row_adv = masked_mean(adv.expand_as(logp), valid, dim=-1).unsqueeze(-1)  # (B, 1)
    sign = torch.sign(row_adv)  # (B, 1)
    clamped = log_ratio.clamp(-s.eps_low, s.eps_high)  # (B, T)
    chosen = sign * torch.minimum(sign * log_ratio, sign * clamped)  # (B, T) the pessimistic one
    rho = torch.exp(masked_mean(chosen, valid, dim=-1)).unsqueeze(-1)  # (B, 1)
    pg = (-row_adv * rho).expand_as(logp)  # (B, T) the row's loss on each of its tokens
    clip_high = (sign > 0) & (log_ratio > s.eps_high)  # (B, T)
    clip_low = (sign < 0) & (log_ratio < -s.eps_low)  # (B, T)
    return SurrogateTerms(pg, torch.exp(log_ratio).detach(), clip_low, clip_high)


SAPO_HALF_GATE = 2 * math.log(1 + math.sqrt(2))
"""|tau (w - 1)| beyond which SAPO's gate weight 4 s (1 - s) is below 1/2 (1.7627...)."""


def sapo_surrogate(logp: Tensor, old: Tensor, adv: Tensor, valid: Tensor, s: LossSettings) -> SurrogateTerms:
    """SAPO: -(4 / tau) sigmoid(tau (w - 1)) A, tau by the sign of A: a soft trust region."""
    ratio = importance_ratio(logp, old, valid, s.ratio_level)  # (B, T)
    tau_pos, tau_neg = s.sapo_tau
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(ratio.dtype)  # (B, 1) or (B, T)
    pg = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv  # (B, T)
    gated = (tau * (ratio.detach() - 1.0)).abs() > SAPO_HALF_GATE  # (B, T) gate weight < 1/2
    return SurrogateTerms(pg, ratio.detach(), gated & (ratio < 1.0), gated & (ratio > 1.0))


SURROGATES = {"clip": clipped_surrogate, "cispo": cispo_surrogate, "gmpo": gmpo_surrogate, "sapo": sapo_surrogate}
NEEDS_TOKEN_RATIOS = ("cispo", "gmpo")
"""The surrogates that read each token's own ratio (no GSPO sequence ratio)."""


def check_settings(s: LossSettings) -> None:
    """ValueError for knobs out of range or that do not go together."""
    if s.surrogate not in SURROGATES:
        raise ValueError(f"surrogate must be one of {', '.join(SURROGATES)}; got {s.surrogate!r}")
    if s.surrogate in NEEDS_TOKEN_RATIOS and s.ratio_level != "token":
        raise ValueError(f"surrogate {s.surrogate!r} needs ratio_level 'token'")
    if s.surrogate == "sapo" and not min(s.sapo_tau) > 0:
        raise ValueError(f"sapo_tau must be two temperatures > 0; got {s.sapo_tau}")
    if s.dual_clip is not None and (s.dual_clip <= 1.0 or s.surrogate != "clip"):
        raise ValueError(f"dual_clip must be > 1 and goes with surrogate 'clip'; got {s.dual_clip}")
    if s.tis_cap is not None and s.tis_cap < 1.0:
        raise ValueError(f"tis_cap must be >= 1; got {s.tis_cap}")
    if s.tis_floor is not None and not 0 < s.tis_floor <= 1:
        raise ValueError(f"tis_floor must be in (0, 1]; got {s.tis_floor}")
    if s.tis_mode not in TIS_MODES:
        raise ValueError(f"tis_mode must be one of {', '.join(TIS_MODES)}; got {s.tis_mode!r}")
    if s.off_policy_mask is not None and not s.off_policy_mask > 0:
        raise ValueError(f"off_policy_mask must be > 0; got {s.off_policy_mask}")


def high_entropy_mask(entropy: Tensor, mask: Tensor, share: float) -> Tensor:
    """(B, T) bool: the valid tokens whose entropy is among the highest `share` of the valid ones
    (ceil(share x valid), ties kept); share 1 keeps every valid token."""
    valid = mask.bool()  # (B, T)
    count = int(valid.sum())
    if share >= 1 or count == 0:
        return valid
    keep = math.ceil(share * count)  # >= 1: share > 0
    threshold = entropy[valid].float().topk(keep).values[-1]  # () the keep-th largest
    return valid & (entropy.float() >= threshold)  # (B, T)


def policy_loss(logp: Tensor, inputs: LossInputs, settings: LossSettings = LossSettings()) -> LossOutput:
    """The one GRPO-family loss: a surrogate (+ beta * KL), aggregated; see the module doc.

    logp (B, T) requires grad; everything in `inputs` is treated as a constant.
    clip_fraction counts valid tokens at a clip bound: under "clip", those whose gradient it removed
    (A > 0 and w > 1 + eps_high, A < 0 and w < 1 - eps_low, or with dual_clip A < 0 and w > c);
    under "cispo", those whose weight it capped; under "gmpo", those whose log-ratio it clipped;
    under "sapo", those whose gate weight fell below 1/2.
    """
    s = settings
    check_settings(s)
    if s.beta > 0 and inputs.ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (log-probs of the reference model)")
    valid = inputs.mask.bool()  # (B, T) every sampled token: the mismatch, TIS and KL statistics
    counted = valid if inputs.trained_mask is None else inputs.trained_mask.bool() & valid  # (B, T) the loss's
    adv = inputs.advantages.detach().to(logp.dtype)  # (B,) or (B, T)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv  # (B, 1) or (B, T)
    old = inputs.old_logp.detach()  # (B, T)
    pg, ratio, clip_low, clip_high = SURROGATES[s.surrogate](logp, old, adv, counted, s)  # (B, T) each

    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    mismatch_kl, tis_capped, dropped_share = zero, zero, zero
    tis_mean = valid.any().to(logp.dtype)  # 1 (0 on an empty mask) when off
    if inputs.sampler_logp is not None:
        old, sampler = old.to(logp.dtype), inputs.sampler_logp.detach().to(logp.dtype)  # (B, T)
        mismatch_kl = masked_mean(kl_penalty(sampler, old, "k3"), valid)  # samples drawn by the sampler
        if s.tis_cap is not None or s.tis_floor is not None:
            weight, capped = tis_weights(old, sampler, valid, s)  # (B, T) each
            pg = pg * weight  # (B, T)
            tis_mean, tis_capped = masked_mean(weight, valid), masked_mean(capped.to(logp.dtype), valid)
        if s.off_policy_mask is not None:
            dropped = off_policy_rows(logp, sampler, adv, valid, s.off_policy_mask)  # (B, 1)
            pg = torch.where(dropped, torch.zeros_like(pg), pg)  # (B, T)
            dropped_share = dropped.to(logp.dtype).mean()

    per_token = pg  # (B, T)
    kl_mean = zero
    if inputs.ref_logp is not None:
        kl = kl_penalty(logp, inputs.ref_logp.detach(), s.kl_kind)  # (B, T)
        kl_mean = masked_mean(kl.detach(), valid)
        if s.beta > 0:
            per_token = pg + s.beta * kl  # (B, T)

    return LossOutput(
        loss=aggregate(per_token, counted, s.aggregation, s.max_len),  # ()
        pg_loss=aggregate(pg.detach(), counted, s.aggregation, s.max_len),
        kl=kl_mean,
        clip_fraction=masked_mean((clip_low | clip_high).to(logp.dtype), counted),
        clip_low_fraction=masked_mean(clip_low.to(logp.dtype), counted),
        clip_high_fraction=masked_mean(clip_high.to(logp.dtype), counted),
        ratio_mean=masked_mean(ratio, counted),
        mismatch_kl=mismatch_kl,
        tis_weight_mean=tis_mean,
        tis_capped_fraction=tis_capped,
        off_policy_masked_fraction=dropped_share,
    )
