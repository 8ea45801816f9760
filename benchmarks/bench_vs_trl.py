"""vlmrl against TRL's GRPOTrainer on the same model, batch and settings, in one process.

Run: `python benchmarks/bench_vs_trl.py [--prompts 2 --group 8 --image 448 --tokens 32 ...]`
(needs the `bench` extra: `pip install -c constraints-cpu.txt -e '.[bench]'`).

Both sides train the same offline tiny Qwen2.5-VL (random weights, saved to a temporary folder, so
TRL can reload its reference from `config._name_or_path`) on the same prompts: one square image
(448x448 by default: 256 image tokens) and a short question. Same G, same completion length
(min = max new tokens, so no completion stops early), same beta (both keep a reference model),
same gradient checkpointing, same dtype (fp32 by default: no autocast on the TRL side), same
micro-batch, learning rate and clip range, one optimizer step per rollout batch, the same reward.

The two trainers run alternately: each TRL optimizer step (driven by `trainer.train()`) is
followed, from a callback, by one vlmrl step (`collect_experience` + `update_policy`, the body
of `vlmrl.training.trainer.train`). The first `--warmup` steps of each are dropped; the figures are
medians over the next `--steps`. Per step:
- vision rows: rows given to the vision tower (image patches), counted by a forward hook on the
  policy's and the reference's vision tower;
- step time; generation (prompt processing, sampling, decoding), reward, and the training phase:
  the rest (reference and old log-probs, forward/backward, optimizer);
- peak memory: on a GPU, torch's peak allocated memory during the step; on a CPU, the peak rise
  of the process's resident memory during the step (sampled every millisecond; the script re-runs
  itself with MALLOC_MMAP_THRESHOLD_=65536 so freed tensors go back to the system). vlmrl's adds
  the KV cache its compiled decoding keeps from one step to the next (decoding.kept_cache_held),
  which is allocated before a later step's window opens and is alive through it.
- training model FLOPs, TFLOP/s, MFU: the training phase's model FLOPs (`StepWork.flops`: 6 x
  parameters x tokens for the update, 2 x parameters x tokens for each extra forward, i.e. the
  reference's; the text model on text and image tokens, the vision tower on its own patches;
  attention's own FLOPs and gradient checkpointing's recomputation left out, as MFU counts them)
  over the phase's time, and over the device's bf16 dense peak: the datasheet's (`--peak-tflops`,
  known for H100 and H200 SXM) and the rate of a large bf16 matrix product measured on the device.
  Each side is counted on the sequences it runs: vlmrl each prompt once per group, TRL each
  prompt G times;
- tokens/s per GPU as EasyR1 counts it: prompt + image + response tokens of every sequence (the
  same count for both sides) per second of the training phase.
Each figure is printed for both sides and as the ratio vlmrl / TRL. `--results FILE` appends
the table in Markdown with date, machine and command; `--json FILE` writes the same figures by row
and side (gpu_check.py's table reads them).

`--video` runs the motion task's video prompts (`--frames` frames of `--image` pixels, the bench's
reward) on three sides: TRL with each video's frames as images (TRL 1.16's GRPOTrainer takes no video:
its dataset columns are prompt, image and images, and it reads only image parts from a prompt, so
frames as images are what a TRL user can feed it), vlmrl on the same prompts as video (each video
encoded once per group; the Qwen family's temporal patch puts two frames in one patch), and vlmrl on
the same frames as images, which separates the two effects: vlmrl (frames) / TRL is the saving of
encoding once per group, vlmrl (video) / vlmrl (frames) that of giving the frames as a video. The
table adds each step's CPU seconds (user + sys of the process, resource.getrusage) beside its wall
seconds; the header gives the load average.

`--vlmrl-only` runs vlmrl's steps alone and prints its column: a variant of vlmrl's own step
(`--dense-attention`, `--vision-loop`, `--fused-kernels`, `--no-checkpointing`) measured against
the TRL column of a full run in the same setting, without paying for TRL's steps again (minutes
each on the 3B architecture). `--decode` picks vlmrl's decode path (`rollout.decode`; "dynamic" skips the
compilation where only the training phase is of interest). `--profile FILE` runs one more vlmrl step
under torch.profiler and writes where its time went (phases, operators, on CUDA the kernels).
`--time-budget SECONDS` starts no new step after that long once every side has a measured step,
so a run under a hard time limit (a lent GPU's 10 minutes a call) publishes a table over fewer
steps instead of none; the header says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so `bench_vs_trl:CircleTask` imports

from vlmrl.models.tiny_model import ARCHES
from vlmrl.tasks import Example, Task
from vlmrl.tasks.base import TaskParams

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}
"""Dense bf16 tensor-core peak by GPU name fragment (SXM parts), TFLOP/s."""

QUESTION = "How many circles are in the image? Think, then answer inside <answer> </answer>."


def circle_image(idx: int, size: int) -> Image.Image:
    """1-5 blue circles on white, placed from idx."""
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    r = size // 12
    for k in range(1 + idx % 5):
        x = (37 * (idx + 3 * k)) % (size - 2 * r) + r
        y = (53 * (idx + 5 * k)) % (size - 2 * r) + r
        draw.ellipse((x - r, y - r, x + r, y + r), fill="blue")
    return image


def reward_of(text: str) -> float:
    """The same reward on both sides: the share of the letter 'a' among the letters (a signal from
    step 1 even for a random model)."""
    letters = [c for c in text if c.isalpha()]
    return sum(c == "a" for c in letters) / len(letters) if letters else 0.0


@dataclasses.dataclass
class CircleParams(TaskParams):
    image: int = 448
    """Image side in pixels."""


def bench_score(example: Example, completion: str) -> dict[str, float]:
    """The bench's reward as a task's score (every bench task scores so)."""
    value = reward_of(completion)
    return {"total": value, "accuracy": float(value == 1.0)}


class CircleTask(Task):
    """Example idx: circle_image(idx) and QUESTION, for vlmrl's trainer (the TRL dataset holds the same)."""

    name = "bench_circles"
    description = "Benchmark prompts: circles at --image pixels."
    Params = CircleParams

    def _example(self, idx: int, split: str) -> Example:
        return Example(image=circle_image(idx, self.params.image), prompt=QUESTION, answer=str(1 + idx % 5))

    def score(self, example: Example, completion: str) -> dict[str, float]:
        return bench_score(example, completion)


@dataclasses.dataclass
class MotionParams(TaskParams):
    frames: int = 4
    """Frames per video."""
    image: int = 112
    """Frame side in pixels."""
    as_images: bool = False
    """Each video's frames given as images (what TRL can take) instead of the video."""


def frames_as_images(example: Example) -> Example:
    """`example` with each video's frames as images, in order, before the question (its `<video>`
    markers dropped): the prompt a TRL user builds from a video."""
    frames = [frame for video in example.videos for frame in video.frames]
    return Example(prompt=example.prompt.replace("<video>", ""), answer=example.answer, images=frames,
                   meta=example.meta, reference_completion=example.reference_completion)


class MotionTask(Task):
    """The motion task's example idx (a video of --frames frames at --image pixels), with the bench's
    reward; with `as_images`, its frames as images."""

    name = "bench_motion"
    description = "Benchmark prompts: the motion task's videos, or their frames as images."
    Params = MotionParams

    def __init__(self, params: MotionParams | None = None) -> None:
        from vlmrl.tasks import get_task

        super().__init__(params)
        self.motion = get_task("motion", frames=self.params.frames, image_size=self.params.image)

    def _example(self, idx: int, split: str) -> Example:
        example = self.motion.example(idx, split)
        return frames_as_images(example) if self.params.as_images else example

    def score(self, example: Example, completion: str) -> dict[str, float]:
        return bench_score(example, completion)


def bench_task(args, as_images: bool = False) -> tuple[str, str]:
    """(task.name, task.params) of the prompts vlmrl's side trains on: circles, or with --video the
    motion task's videos (or their frames as images)."""
    if args.video:
        return ("bench_vs_trl:MotionTask",
                f"{{frames: {args.frames}, image: {args.image}, as_images: {str(as_images).lower()}}}")
    return "bench_vs_trl:CircleTask", f"{{image: {args.image}}}"


def qwen25vl_3b_folder(out: Path, image: int, text_layers: int = 36, vision_depth: int = 32) -> str:
    """A folder with the Qwen2.5-VL-3B architecture (random weights, bf16), the tiny model's
    tokenizer and an image processor that keeps `image`-pixel squares whole (896: 1024 image
    tokens). Fewer layers (`text_layers`, `vision_depth`) give a quick smoke test of the same path."""
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen2VLImageProcessorPil
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

    from vlmrl.models.processing import image_text_processor_class
    from vlmrl.models.tiny_model import build_tokenizer

    tok = build_tokenizer(512, "qwen2_5_vl")
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=text_layers,
                num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
                bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                tie_word_embeddings=True, **ids)
    vision = dict(depth=vision_depth, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=112,
                  fullatt_block_indexes=[i for i in (7, 15, 23, 31) if i < vision_depth], tokens_per_second=2)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=image * image, patch_size=14, merge_size=2,
                                      temporal_patch_size=2)
    image_text_processor_class(Qwen2_5_VLProcessor)(image_processor=images, tokenizer=tok,
                                                    chat_template=tok.chat_template).save_pretrained(out)
    return str(out)


# --------------------------------------------------------------------------- measuring


class MemoryPeak:
    """Peak memory during a window: CUDA peak allocated, or the peak rise of resident memory."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.base = self.peak = 0
        self.lock = threading.Lock()  # a poll racing start() would carry the last window's peak over
        self.running = not self.cuda
        if self.running:
            threading.Thread(target=self._poll, daemon=True).start()

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _poll(self) -> None:
        while self.running:
            with self.lock:
                self.peak = max(self.peak, self.rss())
            time.sleep(0.001)

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with self.lock:
                self.base = self.peak = self.rss()

    def stop(self) -> float:
        """Peak bytes above the start of the window, in MiB."""
        if self.cuda:
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - self.base) / 2 ** 20
        with self.lock:
            self.peak = max(self.peak, self.rss())
            return (self.peak - self.base) / 2 ** 20


class Timer:
    """Seconds spent inside wrapped functions since the last reset."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


@dataclasses.dataclass
class Side:
    """One trainer's per-step measurements. A side named "TRL..." runs each prompt and image G times
    in its training phase (its FLOPs count them so); the first side is what the others are divided by."""

    name: str
    steps: list[dict] = dataclasses.field(default_factory=list)

    @property
    def repeats_prompts(self) -> bool:
        return self.name.startswith("TRL")

    def median(self, key: str, skip: int) -> float:
        return statistics.median(s[key] for s in self.steps[skip:])


@dataclasses.dataclass
class StepWork:
    """What one training phase computes: parameters, and the tokens and patches each side runs."""

    text_params: int
    vision_params: int
    prompt_tokens: int  # P: one prompt's tokens, image tokens included
    patches: int  # one image's rows into the vision tower
    prompts: int  # B
    group: int  # G
    completion: int  # T: every completion runs to max new tokens
    forwards: int  # extra forwards without gradient (1 with a reference model)

    def flops(self, prompt_copies: int) -> float:
        """Model FLOPs when each prompt (and image) is run `prompt_copies` times (1: packed, G: repeated)."""
        tokens = self.prompts * (prompt_copies * self.prompt_tokens + self.group * self.completion)
        patches = self.prompts * prompt_copies * self.patches
        per_pass = self.text_params * tokens + self.vision_params * patches  # a forward: 2 FLOPs each
        return (6 + 2 * self.forwards) * per_pass

    @property
    def easyr1_tokens(self) -> int:
        """Prompt + image + response tokens of every sequence."""
        return self.prompts * self.group * (self.prompt_tokens + self.completion)


def step_work(args, session, example: Example) -> StepWork:
    """The training phase's work in the benchmark's setting (every prompt is as long as `example`'s)."""
    from vlmrl.models.loading import is_vision_parameter
    from vlmrl.rollout.prompts import encode_prompts

    named = list(session.policy.named_parameters())
    vision = sum(p.numel() for n, p in named if is_vision_parameter(n))
    encoded = encode_prompts(session.processor, [example], torch.device("cpu"))
    patches = sum(int(encoded[key].shape[0]) for key in ("pixel_values", "pixel_values_videos") if key in encoded)
    return StepWork(text_params=sum(p.numel() for _, p in named) - vision, vision_params=vision,
                    prompt_tokens=int(encoded["attention_mask"].sum()), patches=patches,
                    prompts=args.prompts, group=args.group, completion=args.tokens, forwards=int(args.beta > 0))


def cpu_seconds() -> float:
    """User + sys CPU seconds of this process so far (every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_tflops(args) -> float | None:
    """The device's bf16 dense peak (--peak-tflops, else known GPUs), None when unknown or not bf16."""
    if args.peak_tflops:
        return args.peak_tflops
    if args.device != "cuda" or args.dtype != "bfloat16":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def measured_peak_tflops(args) -> float | None:
    """The bf16 rate of a large matrix product on this GPU (8192^3, median of 10 after 3), TFLOP/s:
    the ceiling the device reaches here (the issue's ~790 on an H200), beside the datasheet's peak.
    None off CUDA or not bf16."""
    if args.device != "cuda" or args.dtype != "bfloat16":
        return None
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    times = []
    for _ in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)  # seconds
    del a, b
    return 2 * n ** 3 / statistics.median(times[3:]) / 1e12


def bench_model(args, out: Path) -> str:
    """The offline model a benchmark runs: a saved folder (`--model`), the 3B architecture
    (`--arch-3b`, `--layers` text layers, `--vision-depth` vision blocks where the benchmark has
    it) or a tiny model (`--size`, of the family `--arch` where the benchmark has it)."""
    from vlmrl.models import build_tiny_model

    if getattr(args, "model", None):
        return args.model
    if args.arch_3b:
        return qwen25vl_3b_folder(out, args.image, args.layers, getattr(args, "vision_depth", 32))
    return str(build_tiny_model(out, size=args.size, arch=getattr(args, "arch", "qwen2_5_vl")))


def publish(lines: list[str], results: str | None) -> None:
    """Print a benchmark's Markdown lines, and append them to `results` when given."""
    print("\n".join(lines))
    if results:
        with open(results, "a") as f:
            f.write("\n".join(lines) + "\n")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- the two trainers


def vlmrl_stepper(args, model_dir: str, out_dir: Path, memory: MemoryPeak, side: Side, as_images: bool = False):
    """A function that runs one vlmrl training step and records it in `side` (with --video: on the
    videos, or with `as_images` on their frames as images)."""
    from vlmrl.config import load_config
    from vlmrl.models.loading import counting_vision_rows
    from vlmrl.rollout.decoding import kept_cache_held
    from vlmrl.seeds import derive_seed
    from vlmrl.tasks import get_task
    from vlmrl.training import experience as experience_module
    from vlmrl.training.experience import GroupSampler, collect_experience
    from vlmrl.training.logprobs import LogprobScorer
    from vlmrl.training.policy_update import update_policy
    from vlmrl.training.session import TrainingSession

    task_name, task_params = bench_task(args, as_images)
    config = load_config(None, [
        f"model.name_or_path={model_dir}", f"model.device={args.device}", f"model.dtype={args.dtype}",
        f"model.gradient_checkpointing={str(args.checkpointing).lower()}",
        f"model.attn_implementation={args.attn}",
        f"task.name={task_name}", f"task.params={task_params}", f"output_dir={out_dir}",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.generation_batch_size={args.prompts}",
        f"rollout.group_size={args.group}", f"rollout.max_new_tokens={args.tokens}",
        f"rollout.share_prompt_cache={str(not args.vlmrl_plain).lower()}", f"rollout.decode={args.decode}",
        f"train.pack_groups={str(not args.vlmrl_plain).lower()}",
        f"train.block_attention={str(not args.dense_attention).lower()}",
        f"train.batched_vision_attention={str(not args.vision_loop).lower()}",
        f"train.fused_kernels={str(args.fused_kernels).lower()}",
        f"train.stochastic_rounding={str(not args.round_to_nearest).lower()}",
        f"train.steps={args.warmup + args.steps + bool(args.profile)}", f"train.lr={args.lr}",
        f"train.micro_batch_size={args.micro}",
        "train.log_rollouts_every=0", "train.trackers=[]", f"algorithm.beta={args.beta}", "seed=0"])
    session = TrainingSession(config, config.train.steps, with_reference=True)
    task = get_task(config.task.name, **config.task.params)
    sampler = GroupSampler.for_run(session, task)
    scorer = LogprobScorer(session.processor, config.rollout.temperature, config.train.pack_groups,
                           config.train.logprob_chunk, config.train.block_attention)
    generate, score = Timer(), Timer()
    plain_generate = session.policy.generate

    def forced_length(**kwargs):  # every completion runs to max_new_tokens, as TRL's is made to
        return plain_generate(**kwargs, min_new_tokens=kwargs["max_new_tokens"])

    session.policy.generate = forced_length
    experience_module.generate_groups = generate.wrap(experience_module.generate_groups)
    sampler.scorer.submit = score.wrap(sampler.scorer.submit)  # the rewards on the step's path: those scored as each
    sampler.scorer.result = score.wrap(sampler.scorer.result)  # call ends, then the wait for the background ones
    towers = [session.policy] + ([session.reference.copy] if session.reference and session.reference.copy else [])
    state = {"step": 0, "cursor": 0}

    def step() -> None:
        generate.seconds = score.seconds = 0.0
        policy = session.policy
        with counting_vision_rows(towers[0]) as rows, counting_vision_rows(towers[-1]) as ref_rows:
            held = kept_cache_held(policy) / 2 ** 20  # allocated before the window: its rise would miss it
            memory.start()
            sync(session.accelerator.device)
            start, cpu = time.perf_counter(), cpu_seconds()
            policy.eval()
            with torch.profiler.record_function("vlmrl: generation and rewards"):  # named in --profile
                experience, state["cursor"] = collect_experience(sampler, state["step"], state["cursor"])
            policy.train()
            torch.manual_seed(derive_seed(config.seed, state["step"], "update"))
            with torch.profiler.record_function("vlmrl: training phase"):
                update = update_policy(session, scorer, experience)
            sync(session.accelerator.device)
            seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
            peak = memory.stop() + held
        state["step"] += 1
        lengths = experience.rollout.lengths
        side.steps.append({"step": seconds, "cpu": cpu, "generate": generate.seconds, "reward": score.seconds,
                           "train": seconds - generate.seconds - score.seconds, "memory": peak,
                           "vision_rows": sum(rows) + (sum(ref_rows) if len(towers) > 1 else 0),
                           "completion_tokens": float(lengths.float().mean()), "loss": update["loss"]})

    return step, session


def profile_step(step, side: Side, path: Path, device: torch.device) -> None:
    """One more vlmrl step under torch.profiler, written to `path`: the phases and operators by CPU
    time and, on CUDA, the kernels by their own GPU time (where the training phase's time goes, for
    MFU). The step is left out of `side`'s figures."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as profiler:
        step()
    side.steps.pop()
    events = profiler.key_averages()
    tables = [("phases and operators by CPU time (host, kernels launched included)", "cpu_time_total")]
    if cuda:
        tables.insert(0, ("kernels and operators by their own GPU time", "self_device_time_total"))
    text = "".join(f"## {title}\n\n{events.table(sort_by=key, row_limit=40, max_name_column_width=90)}\n"
                   for title, key in tables)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# one vlmrl step, {' '.join(sys.argv[1:])}\n\n{text}")
    print(f"profile: {path}")


def trl_columns(args, n: int) -> dict[str, list]:
    """TRL's dataset: `n` conversational prompts with their image (circles), or with --video the motion
    task's first `n` videos, each as its frames in an `images` column with one image part per frame."""
    if not args.video:
        return {"prompt": [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]] * n,
                "image": [circle_image(i, args.image) for i in range(n)]}
    task = MotionTask(MotionParams(frames=args.frames, image=args.image, as_images=True))
    examples = [task.example(i) for i in range(n)]
    return {"prompt": [[{"role": "user", "content": [{"type": "image"}] * len(ex.images)
                         + [{"type": "text", "text": ex.prompt}]}] for ex in examples],
            "images": [ex.images for ex in examples]}


def trl_trainer(args, model_dir: str, out_dir: Path, memory: MemoryPeak, side: Side, after_step):
    """TRL's GRPOTrainer on the same model and prompts; `after_step()` runs after each of its steps
    and returns True when the run should stop there."""
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from vlmrl.models import load_policy
    from vlmrl.models.loading import counting_vision_rows

    datasets.disable_progress_bars()
    dataset = datasets.Dataset.from_dict(trl_columns(args, args.prompts * (args.warmup + args.steps)))

    def reward(prompts, completions, **kwargs) -> list[float]:
        return [reward_of(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    model, processor = load_policy(model_dir, device=args.device, dtype=args.dtype, attn_implementation=args.attn)
    rows_per_step = args.prompts * args.group
    config = GRPOConfig(
        output_dir=str(out_dir), max_steps=args.warmup + args.steps, learning_rate=args.lr,
        per_device_train_batch_size=args.micro, gradient_accumulation_steps=rows_per_step // args.micro,
        num_generations=args.group, max_completion_length=args.tokens,
        generation_kwargs={"min_new_tokens": args.tokens}, temperature=1.0, top_p=1.0, top_k=0,
        beta=args.beta, epsilon=0.2, loss_type="grpo", scale_rewards="group", num_iterations=1,
        bf16=False, fp16=False, gradient_checkpointing=args.checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, use_cpu=args.device == "cpu",
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, adam_beta2=0.99, weight_decay=0.0,
        report_to="none", logging_steps=10 ** 6, save_strategy="no", log_completions=False,
        dataloader_num_workers=0, seed=0, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
                          processing_class=processor)
    generate, score = Timer(), Timer()
    trainer._generate = generate.wrap(trainer._generate)
    trainer._calculate_rewards = score.wrap(trainer._calculate_rewards)
    ref = trainer.ref_model
    device = torch.device(args.device)

    class Measure(TrainerCallback):
        def on_step_begin(self, *_, **__):
            generate.seconds = score.seconds = 0.0
            self.hooks = [counting_vision_rows(trainer.model)] + ([counting_vision_rows(ref)] if ref else [])
            self.rows = [h.__enter__() for h in self.hooks]
            memory.start()
            sync(device)
            self.start, self.cpu = time.perf_counter(), cpu_seconds()

        def on_step_end(self, _args, _state, control, **__):
            sync(device)
            seconds, cpu = time.perf_counter() - self.start, cpu_seconds() - self.cpu
            peak = memory.stop()
            for h in self.hooks:
                h.__exit__(None, None, None)
            side.steps.append({"step": seconds, "cpu": cpu, "generate": generate.seconds, "reward": score.seconds,
                               "train": seconds - generate.seconds - score.seconds, "memory": peak,
                               "vision_rows": sum(sum(r) for r in self.rows), "completion_tokens": float("nan"),
                               "loss": float("nan")})
            control.should_training_stop = after_step()
            return control

    trainer.add_callback(Measure())
    return trainer


# --------------------------------------------------------------------------- report


def table(args, sides: list[Side], work: StepWork | dict[str, StepWork], measured: int) -> list[str]:
    """The Markdown table of `sides` (TRL then vlmrl, or vlmrl alone; with --video TRL then vlmrl's two),
    with each later side divided by the first. `work`: one for every side, or each side's by name."""
    skip, names = args.warmup, [side.name for side in sides]
    works = work if isinstance(work, dict) else {name: work for name in names}
    seconds = {side.name: side.median("train", skip) for side in sides}
    flops = {side.name: works[side.name].flops(works[side.name].group if side.repeats_prompts else 1)
             for side in sides}  # vlmrl: each prompt once per group
    rate = {name: flops[name] / seconds[name] / 1e12 for name in names}  # TFLOP/s
    tokens = {name: works[name].easyr1_tokens / seconds[name] for name in names}
    timed = [("step (s)", "step")] + ([("step CPU (s)", "cpu")] if all("cpu" in s.steps[-1] for s in sides) else [])
    rows = [(label, "{:.0f}" if key in ("vision_rows", "memory") else "{:.3f}",
             {side.name: side.median(key, skip) for side in sides})
            for label, key in [("vision rows / step", "vision_rows"), *timed,
                               ("generation (s)", "generate"), ("training phase (s)", "train"),
                               ("peak memory (MiB)", "memory")]]
    rows += [("training model FLOPs (TFLOP)", "{:.3g}", {n: flops[n] / 1e12 for n in names}),
             ("training TFLOP/s", "{:.3g}", rate)]
    peaks = [("given" if args.peak_tflops else "datasheet", peak_tflops(args)),
             ("measured matmul", measured_peak_tflops(args))]
    for kind, peak in peaks:
        if peak:
            rows.append((f"training MFU (of {kind} {peak:.0f} TFLOP/s)", "{:.1%}", {n: rate[n] / peak for n in names}))
    rows.append(("tokens/s per GPU (EasyR1 count, training)", "{:.0f}", tokens))
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps({label: values for label, _, values in rows}, indent=1))
    base, others = names[0], names[1:]
    lines = [f"| per step (median of {measured} after {skip} warm-up) | " + " | ".join(names)
             + "".join(f" | {name} / {base}" for name in others) + " |",
             "|---|" + "---:|" * (len(names) + len(others))]
    for label, fmt, values in rows:
        cells = [fmt.format(values[n]) for n in names]
        cells += [f"{values[n] / values[base]:.3f}" if values[base] > 0 else "n/a" for n in others]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def model_name(args) -> str:
    if args.model:
        return args.model
    if args.arch_3b:
        return f"Qwen2.5-VL-3B architecture ({args.layers} text layers, {args.vision_depth} vision blocks)"
    return f"tiny-model {args.size}, {getattr(args, 'arch', 'qwen2_5_vl')}"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        names = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu}, {os.cpu_count()} cores{gpu}; torch {torch.__version__}, {platform.platform()}"


def main() -> None:
    launched = time.perf_counter()  # --time-budget counts from here
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step (B)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--image", type=int, default=448,
                        help="image side in pixels (448: 256 image tokens); with --video, each frame's side")
    parser.add_argument("--video", action="store_true",
                        help="the motion task's videos: TRL on their frames as images, vlmrl on the videos and "
                             "on the frames as images")
    parser.add_argument("--frames", type=int, default=4, help="with --video: frames per video")
    parser.add_argument("--tokens", type=int, default=32, help="completion length (min = max new tokens)")
    parser.add_argument("--micro", type=int, default=16, help="completions per forward/backward (both sides)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="measured steps (median)")
    parser.add_argument("--size", default="tiny", help="tiny-model size (tiny, small)")
    parser.add_argument("--arch", default="qwen2_5_vl", choices=ARCHES, help="tiny-model family (vlmrl models)")
    parser.add_argument("--model", default=None, help="a saved model folder instead of a tiny model")
    parser.add_argument("--arch-3b", action="store_true",
                        help="the Qwen2.5-VL-3B architecture with random weights instead of a tiny model (GPU)")
    parser.add_argument("--layers", type=int, default=36, help="with --arch-3b: text layers (36 = the real one)")
    parser.add_argument("--vision-depth", type=int, default=32, help="with --arch-3b: vision blocks (32)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                        help="gradient checkpointing off on both sides (default: on, TRL's default)")
    parser.add_argument("--beta", type=float, default=0.04, help="KL weight on both sides (> 0: a reference)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    parser.add_argument("--vlmrl-plain", action="store_true", help="vlmrl with shared prefix off (control)")
    parser.add_argument("--dense-attention", action="store_true",
                        help="vlmrl's packed passes under the dense mask (train.block_attention=false)")
    parser.add_argument("--vision-loop", action="store_true",
                        help="vlmrl's vision tower with a call per window (train.batched_vision_attention=false)")
    parser.add_argument("--fused-kernels", action="store_true",
                        help="vlmrl with liger's fused RMSNorm and MLP kernels (train.fused_kernels=true; CUDA)")
    parser.add_argument("--round-to-nearest", action="store_true",
                        help="vlmrl's bf16 weights rounded to nearest, as TRL's (train.stochastic_rounding=false)")
    parser.add_argument("--vlmrl-only", action="store_true",
                        help="run vlmrl's steps alone (a variant against an earlier full run's TRL column)")
    parser.add_argument("--decode", default="auto", choices=["auto", "dynamic", "static", "compiled"],
                        help="vlmrl's decode path (rollout.decode)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense peak for MFU (default: bf16 on a known GPU; else no MFU row)")
    parser.add_argument("--results", default=None, help="append the Markdown table to this file")
    parser.add_argument("--json", default=None, help="write the table's figures (JSON, by row and side) to this file")
    parser.add_argument("--time-budget", type=float, default=0, metavar="SECONDS",
                        help="from the script's start: after it, no new step starts once every side has a "
                             "measured step (the figures are then over fewer steps, and say so); 0 = none")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="after the measured steps, one more vlmrl step under torch.profiler: its "
                             "operator tables to FILE (not in the figures)")
    args = parser.parse_args()
    if args.device == "cpu" and os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed tensors return to the system: RSS = live memory
        os.execv(sys.executable, [sys.executable] + sys.argv)
    if (args.prompts * args.group) % args.micro:
        parser.error("--micro must divide prompts x group")
    if args.video and (args.vlmrl_only or args.arch_3b or args.model):
        parser.error("--video runs the tiny model's three sides (not with --vlmrl-only, --arch-3b or --model)")
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    from vlmrl.safety.preflight import speed_line

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_model(args, Path(tmp) / "model")
        memory = MemoryPeak(torch.device(args.device))
        trl, ours, frames = (Side("TRL (frames)"), Side("vlmrl (video)"), Side("vlmrl (frames)")) if args.video \
            else (Side("TRL"), Side("vlmrl"), None)
        step, session = vlmrl_stepper(args, model_dir, Path(tmp) / "vlmrl", memory, ours)
        steps, work = [step], {ours.name: step_work(args, session, session_example(session))}
        if frames is not None:  # the same frames as images: encoding once per group apart from the video's own saving
            frames_step, frames_session = vlmrl_stepper(args, model_dir, Path(tmp) / "frames", memory, frames, True)
            steps.append(frames_step)
            work[frames.name] = work[trl.name] = step_work(args, frames_session, session_example(frames_session))
        else:
            work[trl.name] = work[ours.name]
        started = time.perf_counter()

        def step_then_stop() -> bool:  # one step of each vlmrl side; True when no new step should start
            for one in steps:
                one()
            sides = [ours] if args.vlmrl_only else [trl, ours]
            measured = min(len(side.steps) for side in sides) - args.warmup
            return args.time_budget > 0 and measured >= 1 and time.perf_counter() - launched > args.time_budget

        if args.vlmrl_only:
            for _ in range(args.warmup + args.steps):
                if step_then_stop():
                    break
        else:
            trl_trainer(args, model_dir, Path(tmp) / "trl", memory, trl, step_then_stop).train()
        speedups = speed_line(session.config, session.policy)  # what was taken: an asked-for kernel may fall back
        sides = [ours] if args.vlmrl_only else [trl, ours] + ([frames] if frames is not None else [])
        publish(report(args, sides, work, time.perf_counter() - started, speedups), args.results)
        if args.profile:  # after the figures are out: a run stopped at a time limit keeps them
            profile_step(step, ours, Path(args.profile), torch.device(args.device))
        session.close()
        if frames is not None:
            frames_session.close()
        memory.running = False


def session_example(session) -> Example:
    """The first train example of a vlmrl side's task (every example of a bench task is as long)."""
    from vlmrl.tasks import get_task

    return get_task(session.config.task.name, **session.config.task.params).example(0)


def report(args, sides: list[Side], work: StepWork | dict[str, StepWork], wall: float, speedups: str) -> list[str]:
    """The run's Markdown: a header with date, machine, command and settings, then the table."""
    measured = {len(side.steps) - args.warmup for side in sides}
    assert len(measured) == 1 and 1 <= min(measured) <= args.steps, [len(s.steps) for s in sides]
    measured = measured.pop()
    tokens = sides[-1].median("completion_tokens", args.warmup)
    video = getattr(args, "video", False)
    prompts = (f"the motion task's videos of {args.frames} frames of {args.image}x{args.image} (TRL: the frames as "
               "images)" if video else f"{args.image}x{args.image} images")
    command = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/bench_vs_trl.py"] + sys.argv[1:])
    header = [f"## {datetime.date.today().isoformat()}: {args.prompts} prompts x G={args.group}, "
              f"{prompts}, {args.tokens} completion tokens, {args.dtype}, "
              f"gradient checkpointing {'on' if args.checkpointing else 'off'}, beta {args.beta}",
              "", f"- machine: {machine()}", f"- command: `{command}`",
              f"- model: {model_name(args)} (random weights); "
              f"micro-batch {args.micro}; torch threads {torch.get_num_threads()}; "
              f"vlmrl shared prefix {'off' if args.vlmrl_plain else 'on'}; "
              f"vlmrl attention {'dense mask' if args.dense_attention else 'blocks'}; "
              f"vlmrl vision windows {'looped' if args.vision_loop else 'batched'}; "
              f"vlmrl fused kernels {'on' if args.fused_kernels else 'off'}; "
              + (f"vlmrl bf16 updates {'rounded to nearest' if args.round_to_nearest else 'stochastically rounded'}; "
                 if args.dtype == "bfloat16" else "") +
              f"vlmrl decode {args.decode}; vlmrl completion length {tokens:.0f}; wall {wall:.0f} s; "
              f"load average {os.getloadavg()[0]:.1f} at the end"
              + ("; vlmrl alone (no TRL steps)" if args.vlmrl_only else "")
              + (f"; stopped by --time-budget after {measured} of {args.steps} measured steps"
                 if measured < args.steps else ""),
              f"- vlmrl speedups taken: {speedups}", ""]
    return header + table(args, sides, work, measured) + [""]


if __name__ == "__main__":
    main()
