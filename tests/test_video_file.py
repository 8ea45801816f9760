"""Video files: decoded by PyAV at their own times, sampled to fps and max_frames, and every way a
file can be wrong is one line."""

from __future__ import annotations

import fractions

import numpy as np
import pytest

from vlmrl.errors import VlmrlError
from vlmrl.tasks.video_file import read_video, sampled

av = pytest.importorskip("av")


def write(path, times_ms: list[int], sizes=None) -> str:
    """A video of len(times_ms) frames, frame k a flat grey 40 * k (mod 256), at the given times (ms)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height = (sizes or [(32, 32)])[0]
        stream.pix_fmt, stream.time_base = "yuv420p", fractions.Fraction(1, 1000)
        for k, t in enumerate(times_ms):
            width, height = (sizes or [(32, 32)] * len(times_ms))[k]
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 40 * k % 256, np.uint8), format="rgb24")
            frame.pts, frame.time_base = t, fractions.Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return str(path)


def greys(video) -> list[int]:
    return [round(np.asarray(frame)[..., 0].mean() / 40) for frame in video.frames]


def test_a_file_keeps_its_frames_times_a_variable_rate_included(tmp_path):
    video = read_video(write(tmp_path / "a.mkv", [0, 100, 300, 400, 900]))
    assert video.timestamps == pytest.approx((0.0, 0.1, 0.3, 0.4, 0.9))
    assert greys(video) == [0, 1, 2, 3, 4] and video.frames[0].size == (32, 32)


@pytest.mark.parametrize("times, fps, max_frames, kept", [
    ([0, 0.1, 0.3, 0.4, 0.9], 5, None, [0, 2, 3, 4]),  # steps 0, 0.2, 0.4, 0.6, 0.8: the first frame at or after
    # each not given one yet (0.3 for 0.2, 0.4 for 0.4, 0.9 for 0.6 and 0.8)
    ([0, 0.1, 0.3, 0.4, 0.9], None, 2, [0, 4]),       # the first and the last
    ([0, 0.1, 0.3, 0.4, 0.9], None, 3, [0, 2, 4]),
    ([0, 0.1, 0.3, 0.4, 0.9], 10, 1, [0]),
    ([0.0], 2, 4, [0]),
    # 10000 frames at 30 a second: one a second is every 30th (334 frames), 8 of those evenly spread
    ([k / 30 for k in range(10000)], 1, 8, [30 * round(k * 333 / 7) for k in range(8)]),
])
def test_sampling_by_rate_then_count(times, fps, max_frames, kept):
    assert sampled(times, fps, max_frames) == kept


def test_a_long_file_is_sampled_to_max_frames(tmp_path):
    video = read_video(write(tmp_path / "long.mkv", [100 * k for k in range(40)]), fps=2, max_frames=4)
    # 2 a second: 0, 0.5, ..., 3.5 (8 frames); 4 of them at ranks round(k * 7 / 3): 0, 2, 5, 7
    assert video.timestamps == pytest.approx((0.0, 1.0, 2.5, 3.5)) and len(video.frames) == 4


def test_a_one_frame_file_is_a_one_frame_video(tmp_path):
    video = read_video(write(tmp_path / "one.mkv", [0]), fps=2)
    assert video.timestamps == (0.0,) and video.fps == 1.0


@pytest.mark.parametrize("make, message", [
    (lambda tmp: str(tmp / "missing.mp4"), r"video file '.*missing.mp4' does not exist"),
    (lambda tmp: (tmp / "text.mp4").write_text("not a video") and str(tmp / "text.mp4"), r"cannot read video file"),
    (lambda tmp: (tmp / "empty.mp4").write_bytes(b"") or str(tmp / "empty.mp4"), r"cannot read video file"),
])
def test_a_bad_file_is_one_line(tmp_path, make, message):
    with pytest.raises(VlmrlError, match=message):
        read_video(make(tmp_path))


def test_a_truncated_file_is_one_line(tmp_path):
    path = tmp_path / "cut.mkv"
    data = open(write(path, [100 * k for k in range(5)]), "rb").read()
    path.write_bytes(data[:200])  # the header and nothing of the frames
    with pytest.raises(VlmrlError, match=r"video file '.*cut.mkv' (has no frames|cannot)|cannot read video file"):
        read_video(path)


def test_a_file_with_a_video_stream_and_no_frame_or_with_no_video_stream_is_one_line(tmp_path):
    with av.open(str(tmp_path / "zero.mkv"), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        container.start_encoding()  # the header, then no frame
    with pytest.raises(VlmrlError, match=r"^cannot read video file '.*zero.mkv': \[Errno \d+\] End of file"):
        read_video(tmp_path / "zero.mkv")
    with av.open(str(tmp_path / "sound.mkv"), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate, frame.pts = 8000, 0
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    with pytest.raises(VlmrlError, match=r"^file '.*sound.mkv' holds no video stream$"):
        read_video(tmp_path / "sound.mkv")


@pytest.mark.parametrize("fps, max_frames, message", [
    (0, None, "fps must be > 0"), (-1.5, None, "fps must be > 0"),
    (None, 0, "max_frames must be an integer >= 1"), (None, 2.5, "max_frames must be an integer >= 1")])
def test_bad_sampling_is_one_line(tmp_path, fps, max_frames, message):
    with pytest.raises(VlmrlError, match=message):
        read_video(tmp_path / "whatever.mp4", fps=fps, max_frames=max_frames)


def test_a_dataset_row_s_video_files_become_its_videos_and_a_bad_one_is_a_bad_row(tmp_path, tiny_model_dir):
    """A `video` column of paths relative to the data file: found when the data loads (a missing one is a
    bad row there), decoded when the example is made (a broken one is a bad row then)."""
    import json

    from vlmrl.models import load_policy
    from vlmrl.safety.bad_rows import RowGuard
    from vlmrl.tasks import get_task

    write(tmp_path / "clip.mkv", [0, 500, 1000, 1500])
    (tmp_path / "broken.mkv").write_text("not a video")
    rows = [{"question": "Which way? <video>", "answer": "left", "video": "clip.mkv"},
            {"question": "And here?", "answer": "right", "video": ["clip.mkv", "clip.mkv"]},
            {"question": "Gone?", "answer": "up", "video": "missing.mkv"},
            {"question": "Broken?", "answer": "down", "video": "broken.mkv"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = get_task("dataset", path=str(tmp_path / "train.jsonl"), test_fraction=0, shuffle=False,
                    on_bad_row="skip", video_fps=1, max_frames=8)
    assert task.bad_rows == [("train", 2, "row 2 of split 'train' (" + str(tmp_path / "train.jsonl")
                                + "): video file 'missing.mkv' does not exist (looked in " + str(tmp_path) + ")")]
    first = task.example(0)
    assert len(first.videos) == 1 and first.videos[0].timestamps == pytest.approx((0.0, 1.0))  # 1 a second
    assert greys(first.videos[0]) == [0, 2] and first.prompt.startswith("Which way? <video>")
    assert len(task.example(1).videos) == 2
    with pytest.raises(VlmrlError, match=r"row 3 of split 'train': cannot read video file '.*broken.mkv'"):
        task.example(2)  # the third usable row is row 3
    guard = RowGuard(task, processor=load_policy(tiny_model_dir, device="cpu")[1])
    used, examples = guard.draw([0, 2])
    assert used == [0, 3] and examples[1].meta["row"] == 0  # example 2 (row 3) replaced by example 3 (row 0 again)
    assert list(guard.bad) == [2] and "cannot read video file" in guard.bad[2]
    with pytest.raises(VlmrlError, match="max_frames must be an integer >= 1"):
        get_task("dataset", path=str(tmp_path / "train.jsonl"), max_frames=0)
    with pytest.raises(VlmrlError, match=r"^video_fps must be > 0, got 0.0$"):  # the key the user wrote
        get_task("dataset", path=str(tmp_path / "train.jsonl"), video_fps=0)


def test_a_video_row_past_max_prompt_length_mid_run_is_a_bad_row_never_cut(tmp_path, tiny_model_dir, capfd):
    """Row 5's video has 8 frames (16 video tokens, a prompt of 76) where the others' 2 give 4 (64): past
    a limit of 70 that the preflight's first batch keeps, it stops the run at step 3 in one line with a
    checkpoint, or is replaced and counted (on_bad_row=skip); it used to be trained on whole."""
    import json

    from vlmrl.cli import main
    from vlmrl.report.tracking import read_metrics

    write(tmp_path / "short.mkv", [0, 1000])
    write(tmp_path / "long.mkv", [1000 * k for k in range(8)])
    rows = [{"question": f"Which way {i}? <video>", "answer": "left", "video": "long.mkv" if i == 5 else "short.mkv"}
            for i in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["train", "task.name=dataset", f"task.params.path={tmp_path / 'train.jsonl'}", "task.params.test_fraction=0",
            "task.params.shuffle=false", "task.params.video_fps=1", "task.params.max_frames=8",
            f"model.name_or_path={tiny_model_dir}", "model.device=cpu", "rollout.prompts_per_step=2",
            "rollout.group_size=2", "rollout.max_new_tokens=4", "rollout.max_prompt_length=70", "train.steps=4",
            "train.micro_batch_size=4", "train.save_every=0"]
    assert main([*args, f"output_dir={tmp_path / 'a'}"]) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1
    assert ("error: bad data at step 3: the prompt of train example 5 (row 5 of split 'train'), image none, video of "
            "8 frames 32x32 is 76 tokens (0 of them image tokens, 16 video tokens) > rollout.max_prompt_length=70: "
            "image and video tokens are never cut; stopped with a checkpoint of step 2 in "
            f"{tmp_path / 'a' / 'checkpoints' / 'step_000002'}") in err
    assert main([*args, f"output_dir={tmp_path / 'b'}", "task.params.on_bad_row=skip"]) == 0
    err = capfd.readouterr().err
    assert err.count("warning: skipped a bad row (on_bad_row=skip): the prompt of train example 5") == 1
    assert [row.get("bad_rows_skipped", 0) for row in read_metrics(tmp_path / "b" / "metrics.jsonl")] == [0, 0, 1, 0]


def test_a_file_cut_short_or_damaged_after_its_first_frames_is_one_line(tmp_path):
    """FFmpeg decodes what a cut or damaged file still has and stops without an error: 7 of 40 frames
    used to become a 7-frame video. The file's own declared end (4.0 s) tells it."""
    data = open(write(tmp_path / "whole.mkv", [100 * k for k in range(40)]), "rb").read()
    (tmp_path / "cut.mkv").write_bytes(data[:int(len(data) * 0.3)])
    with pytest.raises(VlmrlError, match=r"video file '.*cut.mkv' is cut short or damaged: its frames end at 0.60 s "
                                         r"of the 4.00 s it declares$"):
        read_video(tmp_path / "cut.mkv")
    damaged = bytearray(data)
    damaged[len(data) // 2:len(data) // 2 + 200] = bytes(200)  # 200 zero bytes in the middle
    (tmp_path / "damaged.mkv").write_bytes(bytes(damaged))
    with pytest.raises(VlmrlError, match=r"'.*damaged.mkv' is cut short or damaged: its frames end at 2.20 s of the "
                                         r"4.00 s"):
        read_video(tmp_path / "damaged.mkv")
    assert len(read_video(tmp_path / "whole.mkv").frames) == 40


def test_a_10000_frame_file_is_read_for_the_frames_kept(tmp_path):
    video = read_video(write(tmp_path / "long.mkv", [100 * k for k in range(10000)]), fps=1, max_frames=8)
    # 1000 s at 10 a second; one a second keeps frames at 0, 1, ..., 999 s; 8 of those at round(k * 999 / 7)
    assert video.timestamps == pytest.approx((0.0, 143.0, 285.0, 428.0, 571.0, 714.0, 856.0, 999.0))
    assert greys(video) == [round(40 * 10 * t % 256 / 40) for t in video.timestamps] == [0, 3, 2, 5, 1, 4, 3, 6]


def test_a_resolution_change_in_a_file_is_one_line_naming_it(tmp_path):
    """Three MJPEG frames, the third 16x32: each JPEG packet carries its own size."""
    path = tmp_path / "sizes.mkv"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mjpeg", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuvj420p"
        for k, (width, height) in enumerate([(32, 32), (32, 32), (16, 32)]):
            encoder = av.CodecContext.create("mjpeg", "w")
            encoder.width, encoder.height, encoder.pix_fmt = width, height, "yuvj420p"
            encoder.time_base = fractions.Fraction(1, 1000)
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 40 * k, np.uint8), format="rgb24")
            frame = frame.reformat(format="yuvj420p")
            frame.pts, frame.time_base = 100 * k, fractions.Fraction(1, 1000)
            for packet in [*encoder.encode(frame), *encoder.encode()]:
                packet.stream, packet.pts, packet.dts = stream, 100 * k, 100 * k
                packet.time_base = fractions.Fraction(1, 1000)
                container.mux(packet)
    with pytest.raises(VlmrlError, match=r"^video file '.*sizes.mkv': video frame 2 is 16x32; frame 0 is 32x32"):
        read_video(path)


def test_a_video_row_past_the_first_batch_on_a_family_without_video_stops_before_step_1(tmp_path, tiny_model_factory,
                                                                                       capfd):
    """Row 5 alone has a video: idefics3 takes none. It used to stop at step 3 (one line, the two steps
    lost); the preflight now counts the data's video rows."""
    import json

    from PIL import Image

    from vlmrl.cli import main

    write(tmp_path / "clip.mkv", [0, 1000])
    Image.new("RGB", (32, 32), "white").save(tmp_path / "a.png")
    rows = [{"question": f"Which way {i}?", "answer": "left", "image": "a.png", "video": ["clip.mkv"] if i == 5 else []}
            for i in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["train", "task.name=dataset", f"task.params.path={tmp_path / 'train.jsonl'}",
                 "task.params.test_fraction=0", f"model.name_or_path={tiny_model_factory('idefics3')}",
                 "model.device=cpu", f"output_dir={tmp_path / 'run'}", "rollout.prompts_per_step=2",
                 "rollout.group_size=2", "rollout.max_new_tokens=4", "train.steps=4"]) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1
    assert ("error: 1 row of the data holds a video, and the model's processor (Idefics3Processor) takes none: "
            "`vlmrl models` lists the families that take video") in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()


def test_video_rows_are_checked_as_image_rows_and_read_inside_the_data_folder(tmp_path, monkeypatch):
    """Two <video> markers for one video, a PNG taken as a 1-frame video, a video path looked up from the
    working folder or outside the data folder, and video_fps=inf: each one line (issue 51, B11 and B15)."""
    import json

    from PIL import Image

    from vlmrl.tasks import get_task

    data = tmp_path / "data"
    data.mkdir()
    write(data / "clip.mkv", [0, 500, 1000])
    write(tmp_path / "elsewhere.mkv", [0, 500])
    Image.new("RGB", (16, 16), "red").save(data / "still.png")
    rows = [{"question": "Which way? <video>", "answer": "left", "video": "clip.mkv"},
            {"question": "<video> then <video>?", "answer": "right", "video": "clip.mkv"},
            {"question": "Out?", "answer": "up", "video": "../elsewhere.mkv"},
            {"question": "Here?", "answer": "down", "video": "elsewhere.mkv"},
            {"question": "Still?", "answer": "down", "video": "still.png"}]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)  # elsewhere.mkv is in the working folder: a video path used to be looked up there
    task = get_task("dataset", path="data/train.jsonl", test_fraction=0, shuffle=False, on_bad_row="skip")
    assert {row: message.split(": ", 1)[1] for _, row, message in task.bad_rows} == {
        1: "the prompt has 2 <video> markers but the row has 1 videos",
        2: f"video file '../elsewhere.mkv' is outside the data folder {data}: paths in a data file are read from its "
           "folder; set task.params.media_root=FOLDER to allow reading there",
        3: "video file 'elsewhere.mkv' does not exist (looked in data)"}
    assert len(task.example(0).videos[0].frames) == 3
    with pytest.raises(VlmrlError, match=r"^row 4 of split 'train': file '.*still.png' is a still image \(png\), "
                                         r"not a video file: give images in the image column$"):
        task.example(1)
    allowed = get_task("dataset", path="data/train.jsonl", test_fraction=0, shuffle=False, on_bad_row="skip",
                       media_root=str(tmp_path))
    assert [row for _, row, _ in allowed.bad_rows] == [1, 3] and len(allowed.example(1).videos[0].frames) == 2
    with pytest.raises(VlmrlError, match=r"^video_fps must be a finite number of frames a second, got inf$"):
        get_task("dataset", path="data/train.jsonl", video_fps=float("inf"))
