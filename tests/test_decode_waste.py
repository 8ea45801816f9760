"""The decode step without waste (issue 46), proven on the CPU under torch.profiler: no copy of a
layer's KV cache in any decode step of the static or the compiled (inductor) path, and one host
sync per STOP_CHECK_EVERY decode steps, not one per token; each check also sees the waste when it
is put back (transformers' SDPA kernel as it runs inside a compiled step, transformers' own
sampling loop). The loop gives transformers' tokens and the sampler's log-probs exactly, and the
grouped kernel transformers' SDPA numbers. Marked gpu (benchmarks/gpu_check.sh): the compiled kernel
on CUDA, the loop around the compiled step replayed as a CUDA graph, and the device waits per
decode step seen by torch's CUDA sync debug mode."""

from __future__ import annotations

import contextlib
import functools
import math
import warnings

import pytest
import torch
from PIL import Image
from torch.profiler import ProfilerActivity, profile

from vlmrl.config import GenerationSettings
from vlmrl.models import load_policy
from vlmrl.models.support import CACHE_KEY
from vlmrl.rollout import decoding, generation
from vlmrl.rollout.decode_loop import STOP_CHECK_EVERY, sample_loop
from vlmrl.rollout.generation import generate_groups
from vlmrl.tasks import Example

pytestmark = pytest.mark.usefixtures("one_thread")

WRITTEN = {"aten::copy_": 1, "aten::index_copy_": 3, "aten::index_put_": 2, "aten::fill_": 0, "aten::zero_": 0}
"""In-place ops that write into an existing tensor: which input's shape is what they write."""


@pytest.fixture(scope="module")
def examples() -> list[Example]:
    return [Example(Image.new("RGB", (56, 84), (200, 10, 10)), "Count.", "1"),
            Example(Image.new("RGB", (112, 112), (20, 100, 10)), "How many circles are in the image?", "2")]


def forced_generate(model, processor, examples, decode: str, tokens: int, around) -> dict:
    """`generate` alone (the static cache is filled before it: one copy per call, not per step) run
    inside the context `around()` (what it yields, as "inside"), all `tokens` steps forced (no stop
    token before); the cache it decoded into besides (as "cache")."""
    plain, captured = model.generate, {}

    def generate(**kwargs):
        with around() as inside:
            out = plain(**kwargs, min_new_tokens=kwargs["max_new_tokens"])
        captured["inside"], captured["cache"] = inside, kwargs[CACHE_KEY]
        return out

    model.generate = generate
    try:
        settings = GenerationSettings(group_size=3, max_new_tokens=tokens, temperature=1.0, decode=decode)
        rollout = generate_groups(model, processor, examples, settings, seed=3)
    finally:
        model.generate = plain
    assert rollout.completion_ids.shape[1] == tokens
    return captured


def profiled_generate(model, processor, examples, decode: str, tokens: int):
    """The profile of a forced `generate` (`forced_generate`), and the cache it decoded into."""
    captured = forced_generate(model, processor, examples, decode, tokens, lambda: profile(
        activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True))
    return captured["inside"], captured["cache"]


@contextlib.contextmanager
def cuda_sync_warnings():
    """The warnings of torch's CUDA sync debug mode: one per operation that waits for the device
    (`item`, `bool`, `nonzero`, a copy from pageable host memory, ...)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def layer_cache_copies(prof, cache) -> list[str]:
    """Each allocation the size of a layer's keys or more, and each in-place write of that many
    elements (a cache copied into a new tensor or over an old one); the profile's own records."""
    keys = cache.layers[0].keys  # (N, h_kv, L, d): one layer's keys, as large as its values
    found = [f"allocation of {e.nbytes()} bytes" for e in prof.profiler.kineto_results.events()
             if e.name() == "[memory]" and e.nbytes() >= keys.nbytes]
    for event in prof.events():
        at = WRITTEN.get(event.name)
        if at is not None and len(event.input_shapes) > at and math.prod(event.input_shapes[at] or [0]) >= keys.numel():
            found.append(f"{event.name} writing {event.input_shapes[at]}")
    return found


def host_syncs(prof) -> int:
    """Reads of a tensor's value by the host: `item` / `bool` of a tensor (`_local_scalar_dense`),
    but not those of `_assert_async` (multinomial's check of its input: a device-side assert on CUDA,
    no sync there)."""
    def under_assert(event) -> bool:
        while event is not None:
            if event.name == "aten::_assert_async":
                return True
            event = event.cpu_parent
        return False

    return sum(e.name == "aten::_local_scalar_dense" and not under_assert(e) for e in prof.events())


def check_decode(model, processor, examples, decode: str) -> tuple[list[str], int]:
    """Cache copies in the decode of 8 forced tokens, and the host syncs 16 more steps add (after a
    first call, not profiled: a compiled step is compiled there, the static cache made)."""
    forced_generate(model, processor, examples, decode, 8, contextlib.nullcontext)
    short, cache = profiled_generate(model, processor, examples, decode, 8)
    long, _ = profiled_generate(model, processor, examples, decode, 24)
    return layer_cache_copies(short, cache), host_syncs(long) - host_syncs(short)


def waste_back(monkeypatch) -> None:
    """What the decode did before issue 46: transformers' SDPA kernel (with the repeated keys it takes
    inside a compiled step) and transformers' sampling loop (a sync per token)."""
    monkeypatch.setattr(generation, "grouped_decode_attention", lambda model: contextlib.nullcontext())
    monkeypatch.setattr(generation, "sample_loop", None)  # custom_generate=None: transformers' loop


def test_the_static_decode_step_copies_no_layer_cache_and_syncs_once_per_k_steps(tiny_model_dir, examples,
                                                                                monkeypatch):
    model, processor = load_policy(tiny_model_dir, device="cpu")
    copies, syncs = check_decode(model, processor, examples, "static")
    assert copies == [] and syncs <= math.ceil(16 / STOP_CHECK_EVERY) == 2
    # the waste put back; eager, transformers folds the query heads itself, so its kernel is made to
    # take the path it takes inside a compiled step (repeat_kv: each layer's keys and values copied)
    waste_back(monkeypatch)
    monkeypatch.setattr("transformers.integrations.sdpa_attention.is_torchdynamo_compiling", lambda: True)
    copies, syncs = check_decode(model, processor, examples, "static")
    assert len(copies) >= 8 * 2 * 2 and syncs == 16  # a copy of keys and values per layer and step


@pytest.mark.slow
def test_the_compiled_decode_step_copies_no_layer_cache_and_syncs_once_per_k_steps(tiny_model_dir, examples,
                                                                                  monkeypatch):
    """inductor's CPU code: its buffers are allocated by the compiled graph, seen as allocations."""
    model, processor = load_policy(tiny_model_dir, device="cpu")
    copies, syncs = check_decode(model, processor, examples, "compiled")
    assert copies == [] and syncs <= 2
    torch._dynamo.reset()  # compiled again, with transformers' kernel and loop
    decoding._kept_caches.pop(model, None)
    waste_back(monkeypatch)
    copies, syncs = check_decode(model, processor, examples, "compiled")
    assert len(copies) >= 8 * 2 and syncs == 16  # the repeated keys and values: fused, 2 buffers per layer


def loop_against_transformers(model, processor, examples, monkeypatch, every: int, decode: str) -> int:
    """Rows that stop at different steps (a fifth of the vocabulary ends a completion), the loop
    stopping up to `every` - 1 steps after the last: the ids and the sampler's log-probs of
    transformers' own loop, greedy and sampled. Returns how many calls ended before the limit."""
    model.generation_config.eos_token_id = list(range(200, 300))
    ended_early = 0
    for temperature in (0, 1.0):
        for seed in range(2):
            settings = GenerationSettings(group_size=3, max_new_tokens=24, temperature=temperature, decode=decode)
            monkeypatch.setattr(generation, "sample_loop", functools.partial(sample_loop, stop_check_every=every))
            ours = generate_groups(model, processor, examples, settings, seed=seed)
            monkeypatch.setattr(generation, "sample_loop", None)
            theirs = generate_groups(model, processor, examples, settings, seed=seed)
            assert torch.equal(ours.completion_ids, theirs.completion_ids)
            assert (ours.sampler_logp is None) == (temperature == 0)
            if temperature:
                assert torch.equal(ours.sampler_logp, theirs.sampler_logp)
            ended_early += ours.completion_ids.shape[1] < 24
    return ended_early


@pytest.mark.parametrize("every", [1, 3, STOP_CHECK_EVERY])
def test_the_loop_gives_transformers_tokens_and_log_probs(tiny_model_dir, examples, monkeypatch, every):
    model, processor = load_policy(tiny_model_dir, device="cpu")
    ended_early = loop_against_transformers(model, processor, examples, monkeypatch, every, "static")
    assert ended_early >= 1  # the loop ran past the last stop and cut those steps off


def attention_inputs(device: str, dtype: torch.dtype, queries: int = 1):
    """A layer's attention call: 4 query heads over 2 key/value heads, 3 rows of 16 keys, a boolean
    mask (B, 1, Q, L) hiding each row's first keys (left padding) and the empty slots."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    query = torch.randn(3, 4, queries, 8, device=device, dtype=dtype)  # (B, h, Q, d)
    key, value = (torch.randn(3, 2, 16, 8, device=device, dtype=dtype) for _ in range(2))  # (B, h_kv, L, d)
    seen = torch.arange(16, device=device)
    mask = (seen >= torch.tensor([0, 3, 5], device=device)[:, None]) & (seen < 12)  # (B, L)
    return module, query, key, value, mask[:, None, None, :].expand(3, 1, queries, 16)


def transformers_sdpa(*args, repeated: bool):
    """transformers' SDPA kernel: folding the query heads (eager, one query) or repeating the keys."""
    from transformers.integrations import sdpa_attention

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sdpa_attention, "is_torchdynamo_compiling", lambda: repeated)
        return sdpa_attention.sdpa_attention_forward(*args, scaling=0.5)[0]


def test_the_grouped_kernel_gives_transformers_sdpa():
    """One query token: the very numbers of transformers' eager fold, and those of its repeated keys
    to rounding; more queries: transformers' kernel itself."""
    from vlmrl.models.grouped_attention import grouped_sdpa_forward, NAME
    from transformers import AttentionInterface

    assert AttentionInterface()[NAME] is grouped_sdpa_forward
    args = attention_inputs("cpu", torch.float32)
    ours = grouped_sdpa_forward(*args, scaling=0.5)[0]  # (B, 1, h, d)
    assert ours.shape == (3, 1, 4, 8)
    assert torch.equal(ours, transformers_sdpa(*args, repeated=False))
    torch.testing.assert_close(ours, transformers_sdpa(*args, repeated=True),
                               atol=1e-6, rtol=0)
    prompt = attention_inputs("cpu", torch.float32, queries=5)
    assert torch.equal(grouped_sdpa_forward(*prompt, scaling=0.5)[0],
                       transformers_sdpa(*prompt, repeated=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_compiled_grouped_kernel_gives_transformers_repeated_keys(dtype):
    """On CUDA, compiled (inductor, as in the decode step) against transformers' repeated keys, eager:
    to fp32 rounding, or bf16's (one ulp at these magnitudes)."""
    from vlmrl.models.grouped_attention import grouped_sdpa_forward

    args = attention_inputs("cuda", dtype)
    compiled = torch.compile(lambda *a: grouped_sdpa_forward(*a, scaling=0.5)[0], fullgraph=True, dynamic=False)
    expected = transformers_sdpa(*args, repeated=True)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(compiled(*args), expected, atol=tolerance, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("decode", ["static", "compiled"])
def test_on_cuda_the_decode_waits_for_the_device_once_per_k_steps(tiny_model_dir, examples, decode):
    """What the CPU's profile cannot see: every operation that waits for a CUDA device (torch's sync
    debug mode), counted over 16 more decode steps (the first call compiles and records the graph)."""
    model, processor = load_policy(tiny_model_dir, device="cuda")

    def syncs(tokens: int) -> int:
        caught = forced_generate(model, processor, examples, decode, tokens, cuda_sync_warnings)["inside"]
        return sum("synchronizing CUDA operation" in str(w.message) for w in caught)

    syncs(8)
    assert syncs(24) - syncs(8) <= math.ceil(16 / STOP_CHECK_EVERY)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_loop_gives_transformers_tokens_on_the_compiled_step(tiny_model_dir, examples, monkeypatch):
    """The loop around the compiled step replayed as a CUDA graph (what "auto" decodes with on CUDA),
    in fp32: transformers' loop's ids and log-probs, the reads of the stop flag one per 8 steps."""
    model, processor = load_policy(tiny_model_dir, device="cuda")
    assert loop_against_transformers(model, processor, examples, monkeypatch, STOP_CHECK_EVERY, "compiled") >= 1
