"""RoundingAdamW and stochastic rounding (stochastic_rounding.py), against torch's AdamW and by hand."""

from __future__ import annotations

import pytest
import torch

from vlmrl.config import load_config
from vlmrl.training import stochastic_rounding
from vlmrl.training.optim import build_optimizer
from vlmrl.training.stochastic_rounding import RoundingAdamW, round_stochastically


def test_a_bf16_value_stays_and_one_between_lands_on_a_neighbour_as_often_as_it_is_near():
    generator = torch.Generator().manual_seed(0)
    exact = torch.tensor([1.0, -3.5, 0.0, 2.0 ** -100])
    assert torch.equal(round_stochastically(exact, generator), exact.bfloat16())
    ulp = 2.0 ** -7  # bf16's unit in the last place at 1
    x = torch.full((200_000,), 1 + ulp / 4)  # a quarter of the way from 1 to 1 + ulp
    rounded = round_stochastically(x, generator).float()
    assert set(rounded.unique().tolist()) == {1.0, 1 + ulp}
    assert float((rounded == 1 + ulp).float().mean()) == pytest.approx(0.25, abs=0.005)  # ~5 sigma
    negative = round_stochastically(-x, generator).float()  # the same rule on the magnitude
    assert float((negative == -1 - ulp).float().mean()) == pytest.approx(0.25, abs=0.005)


def test_on_float32_weights_the_update_is_torchs_adamw():
    torch.manual_seed(0)
    ours_weights = [torch.nn.Parameter(torch.randn(5, 7)), torch.nn.Parameter(torch.randn(3))]
    torch_weights = [torch.nn.Parameter(w.detach().clone()) for w in ours_weights]
    ours = RoundingAdamW([{"params": ours_weights[:1]}, {"params": ours_weights[1:], "lr": 0.05}], lr=0.1,
                         betas=(0.9, 0.99), weight_decay=0.01)
    reference = torch.optim.AdamW([{"params": torch_weights[:1]}, {"params": torch_weights[1:], "lr": 0.05}],
                                  lr=0.1, betas=(0.9, 0.99), weight_decay=0.01)
    for _ in range(5):
        for a, b in zip(ours_weights, torch_weights):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        ours.step()
        reference.step()
    for a, b in zip(ours_weights, torch_weights):
        assert torch.allclose(a, b, atol=1e-6)
    assert set(ours.state[ours_weights[0]]) == set(reference.state[torch_weights[0]])  # same checkpoint keys


def small_steps(optimizer_class, **options) -> torch.Tensor:
    """1M bf16 weights of 0.02, ten AdamW steps of lr 1e-6 along a gradient of 1: the mean weight."""
    weights = torch.nn.Parameter(torch.full((1_000_000,), 0.02).bfloat16())
    optimizer = optimizer_class([weights], lr=1e-6, betas=(0.9, 0.99), weight_decay=0.0, **options)
    for _ in range(10):
        weights.grad = torch.ones_like(weights)
        optimizer.step()
    return weights.detach().float().mean()


def test_small_updates_land_in_expectation_where_rounding_to_nearest_loses_them():
    start = torch.tensor(0.02).bfloat16().float()
    expected = start - 10 * 1e-6  # Adam's normalised step along a constant gradient: lr each time
    assert float(small_steps(torch.optim.AdamW)) == float(start)  # rounded to nearest: nothing moves
    # the mean of 1M stochastically rounded weights: sd of one ~ its ulp (1.2e-4) / 2, of the mean 1e-7
    assert float(small_steps(RoundingAdamW)) == pytest.approx(float(expected), abs=1e-6)


def test_the_noise_is_the_same_for_the_same_seed_and_step_so_resuming_changes_nothing():
    def run(steps: int, resume_after: int | None = None) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1)
        weights = torch.nn.Parameter(torch.randn(4000, generator=generator).bfloat16())
        grads = [torch.randn(4000, generator=generator).bfloat16() for _ in range(steps)]
        optimizer = RoundingAdamW([weights], lr=1e-3, seed=5)
        for i, grad in enumerate(grads):
            if i == resume_after:  # a new optimizer over a copy, from the saved state
                state = optimizer.state_dict()
                weights = torch.nn.Parameter(weights.detach().clone())
                optimizer = RoundingAdamW([weights], lr=1e-3, seed=5)
                optimizer.load_state_dict(state)
            weights.grad = grad
            optimizer.step()
        return weights.detach()

    assert torch.equal(run(3), run(3))
    assert torch.equal(run(3), run(3, resume_after=2))


@pytest.mark.parametrize("chunk", [stochastic_rounding.CHUNK, 999])
def test_each_weight_lands_on_a_bf16_neighbour_of_its_float32_update(monkeypatch, chunk):
    monkeypatch.setattr(stochastic_rounding, "CHUNK", chunk)  # 999: the update in pieces
    torch.manual_seed(0)
    start = torch.randn(10_000).bfloat16()
    ours, exact = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.float())
    ours.grad = torch.randn(10_000).bfloat16()
    exact.grad = ours.grad.float()
    RoundingAdamW([ours], lr=1e-3).step()
    torch.optim.AdamW([exact], lr=1e-3).step()
    # one unit in the last place or less: bf16 keeps 8 significant bits, so within |w| 2^-7
    assert bool(((ours.detach().float() - exact.detach()).abs() <= exact.detach().abs() * 2.0 ** -7).all())
    assert not torch.equal(ours.detach(), exact.detach().bfloat16())  # not simply rounded to nearest


def test_the_compiled_update_lands_next_to_float32_adamw_reproducibly_and_compiles_once():
    """The one-kernel path (its own, counter-based noise): each weight within one bf16 unit of
    float32 AdamW's, the same numbers when run again (resume), one compile for every tensor length
    and learning rate."""
    torch._dynamo.reset()

    def run(compiled: bool, dtype: torch.dtype) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(3)
        weights = [torch.nn.Parameter(torch.randn(n, generator=generator).bfloat16().to(dtype)) for n in (3000, 1234)]
        optimizer = (RoundingAdamW(weights, lr=1e-3, seed=1, compiled=compiled) if dtype == torch.bfloat16 else
                     torch.optim.AdamW(weights, lr=1e-3))
        for step in range(3):
            for group in optimizer.param_groups:
                group["lr"] = 1e-3 / (step + 1)  # a schedule: new scalars, no new compile
            for w in weights:
                w.grad = torch.randn(w.shape, generator=generator).bfloat16().to(dtype)
            optimizer.step()
        return [w.detach().float() for w in weights]

    compiled, exact = run(True, torch.bfloat16), run(False, torch.float32)
    for a, b in zip(compiled, exact):  # three steps of rounding: within 3 bf16 units
        assert ((a - b).abs() <= b.abs() * 3 * 2.0 ** -7 + 1e-6).all()
    assert all(torch.equal(a, b) for a, b in zip(compiled, run(True, torch.bfloat16)))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2  # pieces of any length, any lr


def test_build_optimizer_rounds_stochastically_for_bf16_weights_only():
    bf16 = torch.nn.Linear(3, 2).bfloat16()
    train = load_config(None, []).train
    assert isinstance(build_optimizer(bf16, train, seed=3), RoundingAdamW)
    assert build_optimizer(bf16, train, seed=3).seed == 3
    off = load_config(None, ["train.stochastic_rounding=false"]).train
    assert type(build_optimizer(bf16, off)) is torch.optim.AdamW
    assert type(build_optimizer(torch.nn.Linear(3, 2), train)) is torch.optim.AdamW  # float32: torch's, fused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compiled", [False, True])
def test_on_cuda_small_updates_land_and_the_noise_is_reproducible(compiled):
    def run() -> torch.Tensor:
        weights = torch.nn.Parameter(torch.full((1_000_000,), 0.02, device="cuda").bfloat16())
        optimizer = RoundingAdamW([weights], lr=1e-6, betas=(0.9, 0.99), weight_decay=0.0, seed=2,
                                  compiled=compiled)
        for _ in range(10):
            weights.grad = torch.ones_like(weights)
            optimizer.step()
        return weights.detach()

    first = run()
    assert torch.equal(first, run())
    start = torch.tensor(0.02).bfloat16().float()
    assert float(first.float().mean()) == pytest.approx(float(start - 10 * 1e-6), abs=1e-6)


def test_the_hashed_noise_is_uniform_16_bit_and_the_same_eager_or_compiled():
    key = torch.tensor(123456789)
    noise = stochastic_rounding.hashed_noise(key, 1 << 16, torch.device("cpu"))
    assert noise.dtype == torch.int32 and int(noise.min()) >= 0 and int(noise.max()) < 1 << 16
    counts = torch.bincount(noise >> 12, minlength=16).float()  # 16 bins of 4096 each, expected
    assert float(((counts - 4096) ** 2 / 4096).sum()) < 45  # chi-square, 15 dof: p ~ 1e-4
    other = stochastic_rounding.hashed_noise(torch.tensor(123456790), 1 << 16, torch.device("cpu"))
    assert float((noise == other).float().mean()) < 0.01  # another key, another stream
    compiled = torch.compile(stochastic_rounding.hashed_noise, dynamic=True)
    assert torch.equal(compiled(key, 1 << 16, torch.device("cpu")), noise)  # integer arithmetic: exact


def test_the_one_kernel_update_is_the_eager_update_given_the_same_noise():
    """issue 46: the compiled kernel hashes its own noise, computes the update and writes in place.
    Given the same noise it is exactly today's update compiled (`adamw_values` under torch.compile,
    the noise passed in), and the same function run as eager ops but for float32 roundings
    (inductor's lerp and division): a rare weight or moment one bf16 unit apart, or a moment that
    cancels to ~0 a few 1e-8 apart."""
    generator = torch.Generator().manual_seed(4)
    tensors = [torch.randn(50_000, generator=generator).bfloat16() for _ in range(4)]
    tensors[3] = tensors[3].abs()  # the second moment
    keys, hyper = torch.tensor([11, 22, 33]), (1e-3, 0.9, 0.999, 1e-8, 0.01, 1 - 0.9 ** 3, (1 - 0.999 ** 3) ** 0.5)
    fused = [t.clone() for t in tensors]
    stochastic_rounding.compiled_update()(fused, keys, hyper)
    noise = tuple(stochastic_rounding.hashed_noise(key, 50_000, torch.device("cpu")) for key in keys.unbind())
    scalars = tuple(torch.tensor(hyper, dtype=torch.float32).unbind())
    today = torch.compile(stochastic_rounding.adamw_values, dynamic=True)(*tensors, noise, scalars)
    for a, b in zip(today, (fused[0], fused[2], fused[3])):
        assert torch.equal(a, b)
    eager = [t.clone() for t in tensors]
    stochastic_rounding.hashed_update(eager, keys, hyper)
    for a, b in zip(eager, fused):
        same = a == b
        assert float(same.float().mean()) > 0.999
        bound = torch.maximum(a.float().abs(), b.float().abs()) * 2.0 ** -7 + 1e-7  # a bf16 unit, or ~0
        assert ((a.float() - b.float()).abs() <= bound)[~same].all()
