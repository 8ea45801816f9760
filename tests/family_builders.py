"""Offline tiny builders for model families beyond vlmrl's own (tiny_model.py): a tokenizer with the
family's special tokens, the family's PIL image processor and processor, and, where a test needs a
forward, a tiny model from the family's config.

The tokenizer is byte-level with no merges (every byte one token), so it builds instantly; the model
sizes follow notes/model-families.md (text hidden 64, 2-3 layers, vision hidden 32, 2 layers).
"""

from __future__ import annotations

import torch
from PIL import Image


def byte_tokenizer(specials: tuple[str, ...], template: str, eos: str, pad: str, bos: str | None = None,
                   named: dict[str, str] | None = None):
    """A left-padding byte-level `PreTrainedTokenizerFast`: the 256 byte tokens, then `specials` (ids
    256, 257, ...); `named` sets attributes such as `image_token` (and `image_token_id`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    bpe = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eos, pad_token=pad, bos_token=bos,
                                  unk_token=None, chat_template=template, extra_special_tokens=named or {})
    tok.padding_side = "left"
    return tok


def chat_template(image: str, start: str = "<|im_start|>", end: str = "<|im_end|>") -> str:
    """A ChatML template that writes `image` where the message puts an image."""
    return ("{% for message in messages %}" + start + "{{ message['role'] }}\n"
            "{% if message['content'] is string %}{{ message['content'] }}"
            "{% else %}{% for part in message['content'] %}"
            "{% if part['type'] == 'image' %}" + image +
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
            "{% endfor %}{% endif %}" + end + "\n{% endfor %}"
            "{% if add_generation_prompt %}" + start + "assistant\n{% endif %}")


CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def internvl_processor(image_seq_length: int = 4):
    """InternVL's processor (GotOcr2 PIL image processor, 56-pixel tiles) through vlmrl's wrapper."""
    from transformers import GotOcr2ImageProcessorPil, InternVLProcessor

    from vlmrl.models.processing import image_text_processor_class

    named = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
             "video_token": "<video>"}
    template = chat_template("<IMG_CONTEXT>")
    tok = byte_tokenizer(CHATML + tuple(named.values()), template, "<|im_end|>", "<|endoftext|>", named=named)
    images = GotOcr2ImageProcessorPil(size={"height": 56, "width": 56}, crop_to_patches=True, min_patches=1,
                                      max_patches=4)
    return image_text_processor_class(InternVLProcessor)(image_processor=images, tokenizer=tok,
                                                         chat_template=template, image_seq_length=image_seq_length)


def llava_onevision_processor():
    """LLaVA-OneVision's processor (PIL image processor, 56-pixel grid) through vlmrl's wrapper, with
    its token-count settings away from their defaults."""
    from transformers import LlavaOnevisionImageProcessorPil, LlavaOnevisionProcessor

    from vlmrl.models.processing import image_text_processor_class

    named = {"image_token": "<image>", "video_token": "<video>"}
    template = chat_template("<image>")
    tok = byte_tokenizer(CHATML + tuple(named.values()), template, "<|im_end|>", "<|endoftext|>", named=named)
    images = LlavaOnevisionImageProcessorPil(size={"height": 56, "width": 56}, crop_size={"height": 56, "width": 56},
                                             image_grid_pinpoints=[[56, 56], [56, 112], [112, 56]])
    return image_text_processor_class(LlavaOnevisionProcessor)(
        image_processor=images, tokenizer=tok, chat_template=template, num_image_tokens=16,
        vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_1")


def gemma4_processor():
    """Gemma 4's processor (feature extractor, image processor, tokenizer; 70 soft tokens at most)
    through vlmrl's wrapper."""
    from transformers import Gemma4ImageProcessorPil, Gemma4Processor
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    from vlmrl.models.processing import image_text_processor_class

    named = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
             "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>"}
    template = chat_template("<|image|>", "<start_of_turn>", "<end_of_turn>")
    specials = ("<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>") + tuple(named.values())
    tok = byte_tokenizer(specials, template, "<end_of_turn>", "<pad>", bos="<bos>", named=named)
    images = Gemma4ImageProcessorPil(patch_size=16, pooling_kernel_size=3, max_soft_tokens=70)
    return image_text_processor_class(Gemma4Processor)(
        feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=images, tokenizer=tok,
        chat_template=template, image_seq_length=70)


def llava_next_video_processor():
    """LLaVA-NeXT-Video's processor (video_processor, image_processor, tokenizer: handed on to
    ProcessorMixin positionally in that order) through vlmrl's wrapper; 56-pixel grid."""
    from transformers import LlavaNextImageProcessorPil, LlavaNextVideoProcessor

    from vlmrl.models.processing import image_text_processor_class

    named = {"image_token": "<image>", "video_token": "<video>"}
    template = chat_template("<image>")
    tok = byte_tokenizer(CHATML + tuple(named.values()), template, "<|im_end|>", "<|endoftext|>", named=named)
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56},
                                        image_grid_pinpoints=[[56, 56]])
    return image_text_processor_class(LlavaNextVideoProcessor)(
        image_processor=images, tokenizer=tok, chat_template=template, patch_size=14,
        vision_feature_select_strategy="full")


def square(size: int = 56, color: str = "red") -> Image.Image:
    """A plain-colour RGB image."""
    return Image.new("RGB", (size, size), color)


def encode(processor, images: list[Image.Image], question: str = "How many?") -> dict[str, torch.Tensor]:
    """The processor's outputs for one user turn with `images` then `question`, generation prompt on."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    return dict(processor(images=[images], text=[text], return_tensors="pt", padding=True))


def mllama_model_and_processor():
    """Llama 3.2 Vision at tiny size (3 text layers, cross-attention at layer 1; 4 tiles of 56) and its
    processor. The cross-attention gates start at tanh(0) = 0, which hides the image: set to 1."""
    from transformers import AutoModelForImageTextToText, MllamaConfig, MllamaImageProcessorPil, MllamaProcessor

    template = chat_template("<|image|>")
    tok = byte_tokenizer(("<|begin_of_text|>",) + CHATML + ("<|image|>", "<|python_tag|>"), template, "<|im_end|>",
                         "<|endoftext|>", bos="<|begin_of_text|>", named={"image_token": "<|image|>"})
    processor = MllamaProcessor(image_processor=MllamaImageProcessorPil(size={"height": 56, "width": 56},
                                                                        max_image_tiles=4),
                                tokenizer=tok, chat_template=template)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                  image_size=56, patch_size=14, max_num_tiles=4, intermediate_layers_indices=[0], vision_output_dim=64)
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, cross_attention_layers=[1], bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    config = MllamaConfig(vision_config=vision, text_config=text,
                          image_token_index=tok.convert_tokens_to_ids("<|image|>"))
    model = AutoModelForImageTextToText.from_config(config).eval()
    for layer in model.model.language_model.layers:
        if hasattr(layer, "cross_attn_attn_gate"):
            layer.cross_attn_attn_gate.data.fill_(1.0)
            layer.cross_attn_mlp_gate.data.fill_(1.0)
    return model, processor


def paligemma_model_and_processor():
    """PaliGemma at tiny size (SigLIP 56/14: 16 image tokens; Gemma text 64 wide) and its processor,
    which adds its 1152 location and segmentation tokens to the tokenizer (so the model comes after)."""
    from transformers import AutoModelForImageTextToText, PaliGemmaConfig, PaliGemmaProcessor, SiglipImageProcessorPil

    template = ("{% for message in messages %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
                "{{ part['text'] }}{% endif %}{% endfor %}{% endfor %}")  # the processor puts the image first
    tok = byte_tokenizer(("<pad>", "<bos>", "<eos>", "<image>"), template, "<eos>", "<pad>", bos="<bos>",
                         named={"image_token": "<image>"})
    images = SiglipImageProcessorPil(size={"height": 56, "width": 56})
    images.image_seq_length = 16
    processor = PaliGemmaProcessor(image_processor=images, tokenizer=tok, chat_template=template)
    torch.manual_seed(0)
    config = PaliGemmaConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=56, patch_size=14),
        text_config=dict(model_type="gemma", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                         pad_token_id=tok.pad_token_id),
        image_token_id=tok.convert_tokens_to_ids("<image>"), projection_dim=64)
    return AutoModelForImageTextToText.from_config(config).eval(), processor


def videollama3_model_and_processor():
    """VideoLLaMA3 at tiny size (Qwen2 text 64 wide; vision patch 14, no merge) and its processor through
    vlmrl's wrapper. Its forward has no `logits_to_keep` parameter."""
    from transformers import (AutoModelForImageTextToText, VideoLlama3Config, VideoLlama3ImageProcessorPil,
                              VideoLlama3Processor)

    from vlmrl.models.processing import image_text_processor_class

    template = chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    tok = byte_tokenizer(CHATML + ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"), template,
                         "<|im_end|>", "<|endoftext|>")
    images = VideoLlama3ImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14, merge_size=1)
    processor = image_text_processor_class(VideoLlama3Processor)(image_processor=images, tokenizer=tok,
                                                                 chat_template=template)
    torch.manual_seed(0)
    config = VideoLlama3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           patch_size=14),
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"))
    return AutoModelForImageTextToText.from_config(config).eval(), processor
