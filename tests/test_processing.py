"""The image+text processor without a video slot (models/processing.py) is the family's own: it keeps
the family's settings through save and load, and hands each sub-processor to the family by name,
whatever the family's parameter order."""

from __future__ import annotations

import inspect

import pytest
import torch

import family_builders as fb
from vlmrl.models.loading import load_processor
from vlmrl.models.processing import image_text_processor_class

SETTINGS = {  # builder: (config class, the settings it gives away from the family's defaults)
    "internvl_processor": ("InternVLConfig", {"image_seq_length": 4}),
    "llava_onevision_processor": ("LlavaOnevisionConfig", {
        "num_image_tokens": 16, "vision_feature_select_strategy": "full", "vision_aspect_ratio": "anyres_max_1"}),
}


def saved(tmp_path, processor, config_class: str) -> str:
    """A folder with the processor and a (default) config of its family, as a model folder has."""
    import transformers

    processor.save_pretrained(tmp_path)
    getattr(transformers, config_class)().save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("builder", sorted(SETTINGS))
def test_family_settings_survive_save_and_load(tmp_path, builder):
    config_class, settings = SETTINGS[builder]
    processor = getattr(fb, builder)()
    image = fb.square()
    before = fb.encode(processor, [image])
    loaded = load_processor(saved(tmp_path, processor, config_class))
    assert type(loaded).__name__ == type(processor).__name__
    assert {name: getattr(loaded, name) for name in settings} == settings
    after = fb.encode(loaded, [image])
    assert torch.equal(after["input_ids"], before["input_ids"])  # as many image tokens as before
    assert torch.equal(after["pixel_values"], before["pixel_values"])


def test_derived_constructor_has_the_family_parameters_but_the_video_processor():
    from transformers import Gemma4Processor, InternVLProcessor

    def names(cls):
        return list(inspect.signature(cls.__init__).parameters)

    assert names(image_text_processor_class(InternVLProcessor)) == [
        "self", "image_processor", "tokenizer", "image_seq_length", "chat_template"]
    assert names(image_text_processor_class(Gemma4Processor)) == [
        "self", "feature_extractor", "image_processor", "tokenizer", "chat_template", "image_seq_length",
        "audio_seq_length", "audio_ms_per_token"]
    defaults = inspect.signature(image_text_processor_class(InternVLProcessor).__init__).parameters
    assert defaults["image_seq_length"].default == 256  # the family's own default


def test_a_family_with_another_parameter_order_gets_each_sub_processor_by_name(tmp_path):
    # Gemma 4: (feature_extractor, image_processor, tokenizer, video_processor), handed on by keyword.
    processor = fb.gemma4_processor()
    assert type(processor.image_processor).__name__ == "Gemma4ImageProcessorPil"
    assert type(processor.feature_extractor).__name__ == "Gemma4AudioFeatureExtractor"
    assert not hasattr(processor, "video_processor")
    inputs = fb.encode(processor, [fb.square(112)])
    image_tokens = int((inputs["input_ids"] == processor.image_token_id).sum())
    assert image_tokens == int(inputs["mm_token_type_ids"].sum()) > 0
    loaded = load_processor(saved(tmp_path, processor, "Gemma4Config"))
    assert loaded.image_seq_length == 70
    assert torch.equal(fb.encode(loaded, [fb.square(112)])["input_ids"], inputs["input_ids"])


def test_a_family_that_hands_its_sub_processors_on_in_another_order_gets_each_in_its_place():
    # LLaVA-NeXT-Video: ProcessorMixin.__init__(video_processor, image_processor, tokenizer), positionally.
    processor = fb.llava_next_video_processor()
    assert type(processor.image_processor).__name__ == "LlavaNextImageProcessorPil"
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == processor.image_token_id
    inputs = fb.encode(processor, [fb.square()])
    expected = processor._get_number_of_features(56, 56, 56, 56)  # the family's own count for one 56x56 image
    assert int((inputs["input_ids"] == processor.image_token_id).sum()) == expected > 16
