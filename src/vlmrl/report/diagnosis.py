"""Why is RL not improving: checks of a run's metrics.jsonl, each with its value, threshold and verdict.

Pure: metrics rows (and the run's config.yaml as a dict) in, a list of findings out; the report
(page.py) shows them as a panel and docs/training.md ("When RL is not improving") explains them.
Every check reads what the GRPO trainer logs (training/trainer.py): groups with signal, the reward's
spread, the within-group correlation of the advantage with each reward part (`advantage_corr/*`),
the share of completions a part pays while the answer is wrong (`paid_when_wrong/*`), the
entropy, the clipped and masked shares, the KL and the truncated share. A check reads the mean of
its key over the last third of the steps that logged it (the run as it is now, not as it began);
a key the run never logged makes no finding. Each finding names the settings that act on it
(`levers`), as the config spells them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RECENT = 1 / 3
"""Share of the logged steps (the last ones) a check averages over."""
MIN_GROUPS_WITH_SIGNAL = 0.5
"""Below this share of groups whose completions' rewards differ, most of the batch teaches nothing."""
MIN_REWARD_STD = 0.01
"""A reward spread below this over the whole batch: the rewards do not vary."""
MIN_ACCURACY_ALIGNMENT = 0.5
"""The advantage should rank completions by correctness: its within-group correlation with accuracy."""
MAX_PAID_WHEN_WRONG = 0.2
"""Share of all completions a non-accuracy reward part may pay while the answer is wrong..."""
MIN_DRIVING_CORRELATION = 0.3
"""...before it is a warning, when that part also moves the advantage this much (within groups)."""
MIN_ENTROPY = 0.1
"""Mean entropy of the sampled tokens (nats) under which the policy samples nearly one completion."""
MAX_CLIP_FRACTION = 0.2
"""Share of tokens whose importance ratio left the clip range: the steps are too large."""
MAX_MASKED = 0.2
"""Share of tokens or rows the loss leaves out (TIS-capped, off-policy masked)."""
MAX_TRUNCATED = 0.1
"""Share of completions cut at rollout.max_new_tokens."""
MIN_KL_STEPS = 20
"""Steps before a KL this small says the policy is not moving."""
MIN_KL = 1e-4
"""KL to the reference (nats per token) under which the policy has barely moved."""
MAX_KL_PENALTY = 0.05
"""beta x KL above which the pull back to the reference weighs against advantages of about 1."""


@dataclass(frozen=True)
class Finding:
    """One check of the run: what it measures, the run's value, the threshold, the verdict, why."""

    check: str
    """Short id: signal, reward_spread, accuracy_alignment, paid_when_wrong/<part>, entropy, clip,
    masked, truncated, kl."""
    title: str
    value: str
    threshold: str
    verdict: str
    """"warn" (the check fired), "ok", or "n/a" (measured, but it cannot bind in this run)."""
    message: str
    levers: tuple[str, ...] = ()
    """Config keys (and task parameters) that act on it."""

    @property
    def fired(self) -> bool:
        return self.verdict == "warn"


def diagnose(rows: list[dict], config: dict | None = None) -> list[Finding]:
    """Every check the run's metrics allow, warnings first (in check order), then the rest; [] for
    a run that is not GRPO (no `groups_drawn` logged: SFT)."""
    if not any(is_number(row.get("groups_drawn")) for row in rows):
        return []
    config = config or {}
    found = [finding for check in CHECKS for finding in check(rows, config)]
    return [f for f in found if f.fired] + [f for f in found if not f.fired]


# --------------------------------------------------------------------------- reading the rows


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def values_of(rows: list[dict], key: str) -> list[float]:
    return [float(row[key]) for row in rows if is_number(row.get(key))]


def recent(rows: list[dict], key: str) -> float | None:
    """Mean of `key` over the last third of the steps that logged it (at least one); None if never."""
    values = values_of(rows, key)
    if not values:
        return None
    last = values[-max(1, math.ceil(len(values) * RECENT)):]
    return sum(last) / len(last)


def setting(config: dict, section: str, key: str, default):
    """config.yaml's section.key, or the default when absent."""
    part = config.get(section)
    return part.get(key, default) if isinstance(part, dict) else default


def percent(share: float) -> str:
    return f"{100 * share:.0f}%"


# --------------------------------------------------------------------------- the checks


def signal_share(rows: list[dict]) -> float | None:
    """Groups with signal over groups drawn, summed over the last third of the steps; None: not logged."""
    window = [row for row in rows if is_number(row.get("groups_drawn")) and is_number(row.get("groups_with_signal"))]
    window = window[-max(1, math.ceil(len(window) * RECENT)):]
    drawn = sum(row["groups_drawn"] for row in window)
    return sum(row["groups_with_signal"] for row in window) / drawn if drawn else None


def check_signal(rows: list[dict], config: dict) -> list[Finding]:
    """Groups whose completions' rewards differ: the only ones with a policy gradient."""
    share = signal_share(rows)
    if share is None:
        return []
    group = setting(config, "rollout", "group_size", None)
    value = f"{percent(share)} of groups" + (f" (G={group})" if group else "")
    levers = ("rollout.group_size", "rollout.temperature", "algorithm.dynamic_sampling",
              "algorithm.max_sampling_rounds", "task.params")
    if share >= MIN_GROUPS_WITH_SIGNAL:
        return [Finding("signal", "groups with signal", value, f">= {percent(MIN_GROUPS_WITH_SIGNAL)}", "ok",
                        "most groups carry a learning signal: their completions get different rewards", levers)]
    accuracy = recent(rows, "accuracy")
    if accuracy is not None and accuracy >= 0.5:
        why = (f"mostly all right (accuracy {percent(accuracy)}): the task is too easy for the model; "
               "give it harder examples (task.params), or raise rollout.group_size or rollout.temperature")
    elif accuracy is not None:
        why = (f"mostly all wrong (accuracy {percent(accuracy)}): the task is too hard for the model; "
               "warm it up with `vlmrl sft` or give it easier examples first (task.params, a curriculum "
               "of runs), or raise rollout.group_size")
    else:
        why = "the task is too easy or too hard for the model: raise rollout.group_size or rollout.temperature"
    if not setting(config, "algorithm", "dynamic_sampling", False):
        why += "; algorithm.dynamic_sampling=true draws more prompts to fill the batch with groups that have signal"
    message = f"most groups have no signal: every completion of a group gets the same reward, {why}"
    return [Finding("signal", "groups with signal", value, f">= {percent(MIN_GROUPS_WITH_SIGNAL)}", "warn",
                    message, levers)]


def check_reward_spread(rows: list[dict], config: dict) -> list[Finding]:
    spread = recent(rows, "reward_std")
    if spread is None:
        return []
    ok = spread >= MIN_REWARD_STD
    message = ("the rewards vary across the batch" if ok else
               "the reward hardly varies across the whole batch: look at what it pays with `vlmrl tasks show` "
               "and the rollout viewer below, and check the `rewards` list")
    return [Finding("reward_spread", "reward spread (std over the batch)", f"{spread:.3g}",
                    f">= {MIN_REWARD_STD:g}", "ok" if ok else "warn", message, ("rewards",))]


def reward_levers(config: dict) -> tuple[str, ...]:
    """What weighs the reward parts: the `rewards` list's weights when the run has one, else the
    task's own format weight (dataset, geometry, grounding, zoom) or a `rewards` list to replace it."""
    if config.get("rewards"):
        return "rewards[].weight", "algorithm.reward_aggregation"
    return "task.params.format_weight", "rewards"


def weight_advice(config: dict) -> str:
    if config.get("rewards"):
        return ("lower their weight in the `rewards` list (rewards[].weight), or set "
                "algorithm.reward_aggregation=normalize_then_sum")
    return ("lower their weight (task.params.format_weight of the dataset, geometry, grounding and zoom tasks), "
            "or give the parts as a `rewards` list with weights of your own")


def check_accuracy_alignment(rows: list[dict], config: dict) -> list[Finding]:
    """Does the advantage rank completions by correctness, or do the other reward parts drive it?"""
    alignment = recent(rows, "advantage_corr/accuracy")
    if alignment is None:
        return []
    parts = {key.split("/", 1)[1]: recent(rows, key) for key in _keys(rows, "advantage_corr/")}
    others = sorted(((value, name) for name, value in parts.items() if name != "accuracy" and value is not None),
                    reverse=True)
    drivers = ", ".join(f"{name} r={value:.2f}" for value, name in others[:3])
    title, threshold = "advantage follows accuracy (within-group correlation)", f">= {MIN_ACCURACY_ALIGNMENT:g}"
    if alignment >= MIN_ACCURACY_ALIGNMENT:
        return [Finding("accuracy_alignment", title, f"r={alignment:.2f}", threshold, "ok",
                        "the advantage ranks completions mostly by whether the answer is right", reward_levers(config))]
    accuracy = recent(rows, "accuracy")
    constant = (f" (accuracy {percent(accuracy)}: within a group the completions are nearly all "
                f"{'right' if accuracy >= 0.5 else 'wrong'} alike)"
                if accuracy is not None and not 0.05 < accuracy < 0.95 else "")
    message = (f"the advantage follows the answer's correctness only weakly{constant}: the other reward parts "
               f"drive it{f' ({drivers})' if drivers else ''}; {weight_advice(config)}")
    return [Finding("accuracy_alignment", title, f"r={alignment:.2f}", threshold, "warn", message,
                    reward_levers(config))]


def check_paid_when_wrong(rows: list[dict], config: dict) -> list[Finding]:
    """A part (format, ...) paid while the answer is wrong, and moving the advantage: it teaches itself."""
    findings = []
    for key in _keys(rows, "paid_when_wrong/"):
        name = key.split("/", 1)[1]
        paid, driving = recent(rows, key), recent(rows, f"advantage_corr/{name}")
        title = f"{name} paid while the answer is wrong"
        threshold = (f"<= {percent(MAX_PAID_WHEN_WRONG)} of completions, or r < {MIN_DRIVING_CORRELATION:g} "
                     "with the advantage")
        value = f"{percent(paid)} of completions" + (f", r={driving:.2f}" if driving is not None else "")
        if paid > MAX_PAID_WHEN_WRONG and driving is not None and driving >= MIN_DRIVING_CORRELATION:
            message = (f"the {name} reward is paid while the answer is wrong in {percent(paid)} of completions and "
                       f"moves the advantage (r={driving:.2f}): the model is rewarded for {name} over the answer; "
                       f"lower the {name} weight ({', '.join(reward_levers(config))})")
            findings.append(Finding(f"paid_when_wrong/{name}", title, value, threshold, "warn", message,
                                    reward_levers(config)))
        elif paid > MAX_PAID_WHEN_WRONG:
            message = (f"paid while the answer is wrong in {percent(paid)} of completions, but nearly the same "
                       "within each group: it moves little of the advantage")
            findings.append(Finding(f"paid_when_wrong/{name}", title, value, threshold, "ok", message,
                                    reward_levers(config)))
        else:
            findings.append(Finding(f"paid_when_wrong/{name}", title, value, threshold, "ok",
                                    "rarely paid for a wrong answer", reward_levers(config)))
    return findings


def check_entropy(rows: list[dict], config: dict) -> list[Finding]:
    entropy = recent(rows, "entropy")
    if entropy is None:
        return []
    start = values_of(rows, "entropy")[0]
    value = f"{entropy:.3g} nats/token (first step {start:.3g})"
    levers = ("rollout.temperature", "algorithm.eps_high", "train.lr", "algorithm.beta")
    if entropy >= MIN_ENTROPY:
        return [Finding("entropy", "entropy of the sampled tokens", value, f">= {MIN_ENTROPY:g}", "ok",
                        "the policy still explores", levers)]
    message = ("entropy collapsed: the policy samples nearly the same completion every time, so groups stop "
               "differing; raise rollout.temperature, clip higher (algorithm.eps_high, DAPO's 0.28), lower "
               "train.lr, or keep a KL to the reference (algorithm.beta)")
    return [Finding("entropy", "entropy of the sampled tokens", value, f">= {MIN_ENTROPY:g}", "warn", message,
                    levers)]


def check_clip(rows: list[dict], config: dict) -> list[Finding]:
    clipped = recent(rows, "clip_fraction")
    if clipped is None:
        return []
    levers = ("train.lr", "algorithm.updates_per_batch", "algorithm.eps_low", "algorithm.eps_high")
    title, threshold = "clipped share of tokens", f"<= {percent(MAX_CLIP_FRACTION)}"
    if setting(config, "algorithm", "updates_per_batch", 1) == 1 and not any(values_of(rows, "clip_fraction")):
        return [Finding("clip", title, percent(clipped), threshold, "n/a",
                        "one update per batch (algorithm.updates_per_batch=1): the ratio is 1, nothing is clipped",
                        levers)]
    if clipped <= MAX_CLIP_FRACTION:
        return [Finding("clip", title, percent(clipped), threshold, "ok", "the updates stay inside the clip range",
                        levers)]
    message = (f"clip fraction high: {percent(clipped)} of tokens leave the clip range, so they give no gradient; "
               "the steps are too large: lower train.lr or algorithm.updates_per_batch")
    return [Finding("clip", title, percent(clipped), threshold, "warn", message, levers)]


def check_masked(rows: list[dict], config: dict) -> list[Finding]:
    """Tokens the loss weighs down or drops: TIS-capped (sampler vs trainer) and off-policy masked rows."""
    parts = {key: recent(rows, key) for key in ("tis_capped_fraction", "off_policy_masked_fraction")}
    parts = {key: value for key, value in parts.items() if value is not None}
    if not parts:
        return []
    key, masked = max(parts.items(), key=lambda item: item[1])
    value = ", ".join(f"{name} {percent(share)}" for name, share in parts.items())
    levers = ("algorithm.tis_cap", "algorithm.tis_mode", "algorithm.off_policy_mask", "train.lr")
    if masked <= MAX_MASKED:
        return [Finding("masked", "share masked or capped in the loss", value, f"<= {percent(MAX_MASKED)}", "ok",
                        "the loss keeps nearly every token at full weight", levers)]
    message = (f"{percent(masked)} {'of tokens are capped' if key == 'tis_capped_fraction' else 'of rows are masked'} "
               "in the loss: the sampler's log-probs and the training forward's disagree (a bf16 or compiled "
               "decode, or a policy that moved far); see mismatch_kl, and algorithm.tis_cap / tis_mode / "
               "off_policy_mask, or lower train.lr")
    return [Finding("masked", "share masked or capped in the loss", value, f"<= {percent(MAX_MASKED)}", "warn",
                    message, levers)]


def check_truncated(rows: list[dict], config: dict) -> list[Finding]:
    truncated = recent(rows, "truncated")
    if truncated is None:
        return []
    limit = setting(config, "rollout", "max_new_tokens", None)
    value = percent(truncated) + (f" at {limit} tokens" if limit else "")
    levers = ("rollout.max_new_tokens", "algorithm.overlong_buffer", "algorithm.mask_truncated")
    if truncated <= MAX_TRUNCATED:
        return [Finding("truncated", "completions cut at max_new_tokens", value, f"<= {percent(MAX_TRUNCATED)}",
                        "ok", "completions end before the limit", levers)]
    dropped = (" and algorithm.mask_truncated drops them from the loss"
               if setting(config, "algorithm", "mask_truncated", False) else "")
    message = (f"truncated completions: {percent(truncated)} are cut at rollout.max_new_tokens{dropped}; "
               "raise rollout.max_new_tokens, or make long ones cost (algorithm.overlong_buffer)")
    return [Finding("truncated", "completions cut at max_new_tokens", value, f"<= {percent(MAX_TRUNCATED)}",
                    "warn", message, levers)]


def check_kl(rows: list[dict], config: dict) -> list[Finding]:
    """The KL to the reference: a policy that does not move (lr too low), or a penalty holding it back."""
    kl = recent(rows, "kl")
    beta = setting(config, "algorithm", "beta", None)
    if kl is None:
        return []
    title, levers = "KL to the reference", ("train.lr", "algorithm.beta", "algorithm.ref_refresh_steps")
    threshold = f">= {MIN_KL:g} after {MIN_KL_STEPS} steps; beta x KL <= {MAX_KL_PENALTY:g}"
    if beta == 0 or (beta is None and not any(values_of(rows, "kl"))):
        return [Finding("kl", title, f"{kl:.3g}", threshold, "n/a", "algorithm.beta=0: no reference, KL not measured",
                        levers)]
    steps = len(values_of(rows, "kl"))
    signal = signal_share(rows)
    if steps >= MIN_KL_STEPS and kl < MIN_KL and signal is not None and signal < MIN_GROUPS_WITH_SIGNAL:
        message = (f"the policy has barely moved (KL {kl:.2g} after {steps} steps), as it must with few groups "
                   "carrying signal: there is little gradient; see groups with signal first")
        return [Finding("kl", title, f"{kl:.3g}", threshold, "n/a", message, levers)]
    if steps >= MIN_KL_STEPS and kl < MIN_KL:
        message = (f"the policy has barely moved from where it started (KL {kl:.2g} after {steps} steps): the "
                   "updates are too small to change what it samples; raise train.lr (or train longer)")
        return [Finding("kl", title, f"{kl:.3g}", threshold, "warn", message, levers)]
    if beta is not None and beta * kl > MAX_KL_PENALTY:
        message = (f"the KL penalty weighs beta x KL = {beta * kl:.2g} per token against advantages of about 1: "
                   "it pulls the policy back; lower algorithm.beta, or move the reference along "
                   "(algorithm.ref_refresh_steps)")
        return [Finding("kl", title, f"{kl:.3g} (beta {beta:g})", threshold, "warn", message, levers)]
    return [Finding("kl", title, f"{kl:.3g}", threshold, "ok", "the policy moves, and the penalty does not hold it",
                    levers)]


def _keys(rows: list[dict], prefix: str) -> list[str]:
    """The keys starting with `prefix` that hold a number somewhere, in order of first appearance."""
    return list(dict.fromkeys(key for row in rows for key, value in row.items()
                              if key.startswith(prefix) and is_number(value)))


CHECKS = (check_signal, check_reward_spread, check_accuracy_alignment, check_paid_when_wrong, check_entropy,
          check_clip, check_masked, check_truncated, check_kl)
"""Every check, in the order the panel lists them."""
