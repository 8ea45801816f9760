"""GRPO and its variants as pure tensor math: advantages, KL estimators, one clipped loss.

No model, no IO, no config: the trainer hands in log-probabilities and rewards, and gets back a
scalar loss and a few detached statistics. Every variant is a setting of the same knobs.

The objective. For a prompt, sample a group of G completions y_1..y_G and score them with rewards
r_i. Each completion's advantage compares it with its own group:

    A_i = (r_i - mean_j r_j) / (std_j r_j + eps)      scale="std"   (GRPO, DAPO, GSPO)
    A_i =  r_i - mean_j r_j                           scale="none"  (Dr. GRPO)

The std is the population std of the group (divide by G, `unbiased=False`): the G completions are
the whole group, and z-scores then have a root-mean-square of exactly 1. TRL's GRPOTrainer uses
the sample std (divide by G - 1); its advantages are ours times sqrt((G - 1) / G).

With per-token log-probs logp_t of the policy being trained and old_t of the policy that sampled,
the importance ratio is either per token or per sequence (GSPO, length-normalised):

    ratio_level="token":     w_t = exp(logp_t - old_t)
    ratio_level="sequence":  s   = exp( (1/|y|) sum_t (logp_t - old_t) )
                             w_t = sg[s] * exp(logp_t - sg[logp_t])   (value s, gradient per token)

and the per-token loss is the clipped surrogate plus an optional KL penalty to a reference model:

    l_t = -min(w_t A, clip(w_t, 1 - eps_low, 1 + eps_high) A)  +  beta * KL_t

reduced to a scalar by `aggregate`: mean over all tokens of the batch ("token"), mean per
sequence then over sequences ("sequence"), or sum divided by B * max_len ("constant").

    preset    advantages         eps_low / eps_high  ratio     aggregation  KL         extras
    --------  -----------------  ------------------  --------  -----------  ---------  ---------------------------
    GRPO      z-score ("std")    0.2 / 0.2           token     sequence     beta>0 k3  -
    DAPO      z-score ("std")    0.2 / 0.28          token     token        beta=0     dynamic sampling, overlong
                                                                                       shaping (penalty / filter)
    Dr. GRPO  r - mean ("none")  0.2 / 0.2           token     constant     beta=0     divide by max_new_tokens
    GSPO      z-score ("std")    3e-4 / 4e-4         sequence  sequence     beta=0     -
    cubic     any, then A**3     any                 any       any          any        `cubic_shaping`

When old_logp == logp.detach() (one optimizer step per batch, the common case) every ratio is 1,
nothing is clipped, and the gradient is the REINFORCE gradient -A * grad(logp_t) / normaliser.

Shapes: N rollouts = B rows of the loss; T completion tokens (right-padded, `mask` marks the real
ones). Rewards and advantages are laid out group-contiguous: prompt 0's G completions, then
prompt 1's, and so on.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

AdvantageScale = Literal["std", "none"]
Aggregation = Literal["token", "sequence", "constant"]
RatioLevel = Literal["token", "sequence"]
KLKind = Literal["k1", "k2", "k3"]

LOG_RATIO_CLAMP = 20.0
"""KL estimators clamp log(ref / policy) to [-20, 20]: exp(20) ~ 5e8 is finite in fp16/bf16/fp32,
and a token that far from the reference is a bug to be seen in the stats, not a NaN."""


class LossOutput(NamedTuple):
    """What `policy_loss` returns: the loss to backpropagate and detached statistics."""

    loss: Tensor
    """Scalar, differentiable w.r.t. logp: aggregate(pg + beta * kl)."""
    pg_loss: Tensor
    """Scalar, detached: aggregate(pg), the clipped surrogate alone."""
    kl: Tensor
    """Scalar, detached: mean KL estimate over valid tokens (0 when no ref_logp)."""
    clip_fraction: Tensor
    """Scalar, detached: fraction of valid tokens whose gradient the clip removed."""
    clip_low_fraction: Tensor
    """Scalar, detached: the part of clip_fraction below: A < 0 and w < 1 - eps_low."""
    clip_high_fraction: Tensor
    """Scalar, detached: the part of clip_fraction above: A > 0 and w > 1 + eps_high."""
    ratio_mean: Tensor
    """Scalar, detached: mean importance ratio over valid tokens."""


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


def group_advantages(rewards: Tensor, group_size: int, *, scale: AdvantageScale = "std",
                     eps: float = 1e-6) -> Tensor:
    """(N,) advantages from (N,) group-contiguous rewards: r - group mean, over group std if "std".

    The std is the population std (unbiased=False). A group whose rewards are all equal gets
    advantage 0 exactly, under either scale.
    """
    num_groups = _check_groups(rewards.numel(), group_size)
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none'; got {scale!r}")
    grouped = rewards.float().reshape(num_groups, group_size)  # (N/G, G)
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # (N/G, G)
    if scale == "std":
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)  # (N/G, G)
    return centred.reshape(-1)  # (N,)


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


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                eps_low: float = 0.2, eps_high: float = 0.2, ratio_level: RatioLevel = "token",
                aggregation: Aggregation = "sequence", max_len: int | None = None,
                ref_logp: Tensor | None = None, beta: float = 0.0, kl_kind: KLKind = "k3",
                dual_clip: float | None = None) -> LossOutput:
    """The one GRPO-family loss: clipped surrogate (+ beta * KL), aggregated; see the module doc.

    logp (B, T) requires grad; old_logp, ref_logp (B, T) and advantages (B,) (or (B, T)) are
    treated as constants. mask (B, T) is 1/True on completion tokens that count.
    dual_clip = c > 1 caps the loss of a negative-advantage token at c * |A| (dual-clip PPO).
    clip_fraction counts valid tokens whose gradient a clip removed: A > 0 and w > 1 + eps_high,
    A < 0 and w < 1 - eps_low, or (dual_clip) A < 0 and w > c.
    """
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (log-probs of the reference model)")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1; got {dual_clip}")
    valid = mask.bool()  # (B, T)
    adv = advantages.detach().to(logp.dtype)  # (B,) or (B, T)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv  # (B, 1) or (B, T)
    ratio = importance_ratio(logp, old_logp.detach(), mask, ratio_level)  # (B, T)
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)  # (B, T)
    pg = torch.maximum(-ratio * adv, -clipped * adv)  # (B, T) = -min(w A, clip(w) A)
    clip_high = (adv > 0) & (ratio > 1.0 + eps_high)  # (B, T)
    clip_low = (adv < 0) & (ratio < 1.0 - eps_low)  # (B, T)
    binds = clip_high | clip_low  # (B, T)
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -dual_clip * adv), pg)  # (B, T)
        binds = binds | ((adv < 0) & (ratio > dual_clip))  # (B, T)

    per_token = pg  # (B, T)
    kl_mean = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp.detach(), kl_kind)  # (B, T)
        kl_mean = masked_mean(kl.detach(), valid)
        if beta > 0:
            per_token = pg + beta * kl  # (B, T)

    loss = aggregate(per_token, valid, aggregation, max_len)  # ()
    return LossOutput(
        loss=loss,
        pg_loss=aggregate(pg.detach(), valid, aggregation, max_len),
        kl=kl_mean,
        clip_fraction=masked_mean(binds.to(logp.dtype), valid),
        clip_low_fraction=masked_mean(clip_low.to(logp.dtype), valid),
        clip_high_fraction=masked_mean(clip_high.to(logp.dtype), valid),
        ratio_mean=masked_mean(ratio.detach(), valid),
    )
