"""Recipes for the offline tiny builds of the newer families (`vlmrl tiny-model --arch MODEL_TYPE`).

A recipe is what one family needs beyond the shared byte-level BPE (tiny_model.py): its special
tokens and the tokenizer attributes its processor reads, a chat template of the family's shape
(how a turn opens and closes, how an image is written, which token ends the assistant's turn), a
config at the tiny widths, the family's PIL image processor (no torchvision) with its processor,
and the parameters the family starts at zero so that a random build would ignore the image
(drawn again here: a pixel shift must change the logits, tests/test_tiny_model.py).

Configs and processors are imported inside the builders: `vlmrl --help` reads the family names
without importing torch or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_VISION = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


@dataclass(frozen=True)
class ChatShape:
    """A chat template's shape: how a turn opens and closes, and how an image part is written."""

    opening: str
    """Jinja expression of a turn's opening; `role` is the message's role."""
    closing: str
    """Jinja expression of what follows a turn's content (the assistant's turn ends with the end token)."""
    image: str
    """What the template writes for an image part (the processor expands it to the image's tokens)."""
    generation: str
    """The assistant turn's opening, written by `add_generation_prompt`."""
    start: str = ""
    """Text before the first turn (a BOS the tokenizer does not add)."""
    video: str = ""
    """What the template writes for a video part ("": the family's build takes no video)."""

    def template(self) -> str:
        """The Jinja chat template: no system prompt, images where the message puts them."""
        return (
            f"{self.start}{{% for message in messages %}}{{% set role = message['role'] %}}{{{{ {self.opening} }}}}"
            "{% if message['content'] is string %}{{ message['content'] }}"
            "{% else %}{% for part in message['content'] %}"
            f"{{% if part['type'] == 'image' %}}{self.image}"
            + (f"{{% elif part['type'] == 'video' %}}{self.video}" if self.video else "") +
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
            f"{{% endfor %}}{{% endif %}}{{{{ {self.closing} }}}}{{% endfor %}}"
            f"{{% if add_generation_prompt %}}{self.generation}{{% endif %}}"
        )


CHATML_SHAPE = ChatShape(opening="'<|im_start|>' + role + '\\n'", closing="'<|im_end|>\\n'",
                         image="<|vision_start|><|image_pad|><|vision_end|>", generation="<|im_start|>assistant\n",
                         video="<|vision_start|><|video_pad|><|vision_end|>")


@dataclass(frozen=True)
class Family:
    """How to build one family at tiny size."""

    specials: tuple[str, ...]
    """The family's special tokens, added whole to the tokenizer."""
    eos: str
    """The token that ends the assistant's turn (generation stops there)."""
    pad: str
    chat: ChatShape
    config: Callable
    """(spec, tokenizer, image side in pixels) -> the model's config at the tiny widths."""
    processor: Callable
    """(tokenizer, image side in pixels) -> the processor (PIL image processor, no video slot)."""
    bos: str | None = None
    named: dict[str, str] = field(default_factory=dict)
    """Tokenizer attributes the processor reads (`image_token`, `boi_token`, ...) and their tokens."""
    wake: dict[str, float] = field(default_factory=dict)
    """Parameters the family initialises at zero, so the image would not reach the output: their
    name's ending, and the standard deviation to draw them from instead."""


def ids(tok, **tokens: str) -> dict[str, int]:
    """Config fields that hold token ids: {field: id of its token}."""
    return {name: tok.convert_tokens_to_ids(token) for name, token in tokens.items()}


def text_fields(spec, tok, **more) -> dict:
    """The text model's widths and token ids, shared by every family."""
    return dict(vocab_size=len(tok), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                max_position_embeddings=4096, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, tie_word_embeddings=True, **more)


def vit_fields(spec, side: int, **more) -> dict:
    """A ViT-style vision tower (SigLIP, CLIP, InternViT) at the tiny widths, for `side`-pixel images."""
    return dict(hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden,
                num_hidden_layers=spec.vision_depth, num_attention_heads=spec.vision_heads, image_size=side,
                patch_size=14, **more)


def mrope(head_dim: int, rotary: float = 1.0) -> list[int]:
    """M-RoPE sections (text, height, width) that sum to half the rotary dimensions."""
    half = int(head_dim * rotary) // 2
    quarter = half // 4
    return [half - 2 * quarter, quarter, quarter]


def qwen_images(patch: int, side: int):
    """Qwen-VL's dynamic-resolution image processor (PIL) for images up to `side` pixels a side."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=(2 * patch) ** 2, max_pixels=(4 * side) ** 2, patch_size=patch,
                                    merge_size=2, temporal_patch_size=2)


# --------------------------------------------------------------------------- Qwen2-VL, Qwen2.5-VL


def qwen2_config(kind: str):
    """Qwen2-VL or Qwen2.5-VL at the tiny widths, special token ids set everywhere."""

    def build(spec, tok, side):
        from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

        token_ids = ids(tok, image_token_id="<|image_pad|>", video_token_id="<|video_pad|>",
                        vision_start_token_id="<|vision_start|>", vision_end_token_id="<|vision_end|>")
        head_dim = spec.hidden // spec.heads
        quarter = head_dim // 4  # the sections these builds have always had (not `mrope`'s)
        rope = {"rope_type": "default", "rope_theta": 10000.0,
                "mrope_section": [head_dim // 2 - 2 * quarter, quarter, quarter]}
        text = text_fields(spec, tok, rope_parameters=rope, **token_ids)
        text["bos_token_id"] = tok.pad_token_id  # Qwen's tokenizer has no BOS
        vision = dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden, num_heads=spec.vision_heads,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
        if kind == "qwen2_5_vl":
            vision.update(intermediate_size=2 * spec.vision_hidden, out_hidden_size=spec.hidden, window_size=112,
                          fullatt_block_indexes=list(range(spec.vision_depth)))
            return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **token_ids)
        vision.update(embed_dim=spec.vision_hidden, mlp_ratio=2, hidden_size=spec.hidden)
        return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **token_ids)

    return build


def qwen2_processor(kind: str):
    def build(tok, side):
        from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
        from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

        from vlmrl.models.processing import image_text_processor_class

        base = Qwen2_5_VLProcessor if kind == "qwen2_5_vl" else Qwen2VLProcessor
        from transformers import Qwen2VLImageProcessorPil

        images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448, patch_size=14, merge_size=2,
                                          temporal_patch_size=2)
        return image_text_processor_class(base)(image_processor=images, tokenizer=tok, chat_template=tok.chat_template)

    return build


def qwen2_family(kind: str) -> Family:
    return Family(specials=CHATML + QWEN_VISION, eos="<|im_end|>", pad="<|endoftext|>", chat=CHATML_SHAPE,
                  config=qwen2_config(kind), processor=qwen2_processor(kind))


# --------------------------------------------------------------------------- Idefics3 (SmolVLM)

IDEFICS3_TILE = 112  # pixels per image tile of the tiny Idefics3; real SmolVLM uses 384-512


IDEFICS = {"idefics3": ("Idefics3Config", "Idefics3ImageProcessorPil", "Idefics3Processor"),
           "smolvlm": ("SmolVLMConfig", "SmolVLMImageProcessorPil", "SmolVLMProcessor")}
"""Idefics3 and SmolVLM (the same layout and code): their config, PIL image processor and processor."""


def idefics_config(kind: str):
    def build(spec, tok, side):
        import transformers

        config = getattr(transformers, IDEFICS[kind][0])
        return config(text_config=dict(model_type="llama", **text_fields(spec, tok)),
                      vision_config=vit_fields(spec, IDEFICS3_TILE), scale_factor=2, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=True, **ids(tok, image_token_id="<image>"))

    return build


def idefics_processor(kind: str):
    def build(tok, side):
        import transformers

        from vlmrl.models.processing import image_text_processor_class

        _, image_processor, processor = IDEFICS[kind]
        images = getattr(transformers, image_processor)(
            size={"longest_edge": 2 * IDEFICS3_TILE}, max_image_size={"longest_edge": IDEFICS3_TILE},
            do_image_splitting=False)
        seq_len = (IDEFICS3_TILE // 14) ** 2 // 4  # patches after the 2x2 pixel shuffle
        return image_text_processor_class(getattr(transformers, processor))(
            image_processor=images, tokenizer=tok, image_seq_len=seq_len, chat_template=tok.chat_template)

    return build


IDEFICS3_CHAT = ChatShape(opening="'<|im_start|>' + (role | capitalize) + ':'", closing="'<end_of_utterance>\\n'",
                          image="<image>", generation="Assistant:")


def idefics_family(kind: str) -> Family:
    return Family(specials=CHATML[:2] + ("<end_of_utterance>", "<image>", "<fake_token_around_image>", "<global-img>")
                  + tuple(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
                  eos="<end_of_utterance>", pad="<|endoftext|>", bos="<|im_start|>", chat=IDEFICS3_CHAT,
                  config=idefics_config(kind), processor=idefics_processor(kind))


# --------------------------------------------------------------------------- Qwen3-VL, Qwen3.5


def qwen3_vision(spec, kind: str) -> dict:
    vision = dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden,
                  num_heads=spec.vision_heads, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  out_hidden_size=spec.hidden, num_position_embeddings=64)
    if kind != "qwen3_5":
        vision["deepstack_visual_indexes"] = list(range(min(2, spec.vision_depth)))
    return vision


def qwen3_config(kind: str):
    """Qwen3-VL (dense or MoE) or Qwen3.5 (linear-attention layers between full ones)."""

    def build(spec, tok, side):
        import transformers

        head_dim = spec.hidden // spec.heads
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope(head_dim),
                "mrope_interleaved": True}
        text = text_fields(spec, tok, head_dim=head_dim, rope_parameters=rope)
        if kind == "qwen3_vl_moe":
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=spec.intermediate // 2,
                        decoder_sparse_step=1)
        if kind == "qwen3_5":
            text.update(layer_types=["linear_attention", "full_attention"] * (spec.layers // 2),
                        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_num_key_heads=2,
                        linear_num_value_heads=spec.heads, linear_conv_kernel_dim=4)
            rope["partial_rotary_factor"] = 1.0
        cls = {"qwen3_vl": transformers.Qwen3VLConfig, "qwen3_vl_moe": transformers.Qwen3VLMoeConfig,
               "qwen3_5": transformers.Qwen3_5Config}[kind]
        return cls(text_config=text, vision_config=qwen3_vision(spec, kind), tie_word_embeddings=True,
                   **ids(tok, image_token_id="<|image_pad|>", video_token_id="<|video_pad|>",
                         vision_start_token_id="<|vision_start|>", vision_end_token_id="<|vision_end|>"))

    return build


def qwen3_processor(tok, side):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    from vlmrl.models.processing import image_text_processor_class

    return image_text_processor_class(Qwen3VLProcessor)(image_processor=qwen_images(16, side), tokenizer=tok,
                                                        chat_template=tok.chat_template)


def qwen3_family(kind: str) -> Family:
    return Family(specials=CHATML + QWEN_VISION, eos="<|im_end|>", pad="<|endoftext|>", chat=CHATML_SHAPE,
                  config=qwen3_config(kind), processor=qwen3_processor)


# --------------------------------------------------------------------------- GLM-4.1V


def glm4v_config(spec, tok, side):
    from transformers import Glm4vConfig

    head_dim = spec.hidden // spec.heads
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope(head_dim, 0.5),
            "partial_rotary_factor": 0.5}
    vision = dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden,
                  num_heads=spec.vision_heads, image_size=side, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=spec.hidden)
    return Glm4vConfig(text_config=text_fields(spec, tok, rope_parameters=rope), vision_config=vision,
                       tie_word_embeddings=True,
                       **ids(tok, image_token_id="<|image|>", video_token_id="<|video|>",
                             image_start_token_id="<|begin_of_image|>", image_end_token_id="<|end_of_image|>",
                             video_start_token_id="<|begin_of_video|>", video_end_token_id="<|end_of_video|>"))


def glm4v_processor(tok, side):
    from transformers import Glm4vImageProcessorPil
    from transformers.models.glm4v.processing_glm4v import Glm4vProcessor

    from vlmrl.models.processing import image_text_processor_class

    images = Glm4vImageProcessorPil(size={"shortest_edge": (2 * 14) ** 2, "longest_edge": (4 * side) ** 2},
                                    patch_size=14, merge_size=2, temporal_patch_size=2)
    return image_text_processor_class(Glm4vProcessor)(image_processor=images, tokenizer=tok,
                                                      chat_template=tok.chat_template)


GLM4V = Family(
    specials=("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|begin_of_image|>",
              "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|video|>"),
    eos="<|endoftext|>", pad="<|endoftext|>",
    chat=ChatShape(opening="'<|' + role + '|>\\n'", closing="'<|endoftext|>' if role == 'assistant' else ''",
                   start="[gMASK]<sop>",
                   image="<|begin_of_image|><|image|><|end_of_image|>", generation="<|assistant|>\n"),
    config=glm4v_config, processor=glm4v_processor)


# --------------------------------------------------------------------------- Gemma 3


def gemma3_config(spec, tok, side):
    from transformers import Gemma3Config

    head_dim = spec.hidden // spec.heads
    text = text_fields(spec, tok, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=4096,
                       layer_types=["sliding_attention", "full_attention"] * (spec.layers // 2))
    vision = vit_fields(spec, side)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
                        tie_word_embeddings=True,
                        **ids(tok, boi_token_index="<start_of_image>", eoi_token_index="<end_of_image>",
                              image_token_index="<image_soft_token>"))


GEMMA3_IMAGE_TOKENS = 16  # the pooled soft tokens per image (256 in the released models)


def gemma3_processor(tok, side):
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    images = Gemma3ImageProcessorPil(size={"height": side, "width": side})
    return Gemma3Processor(image_processor=images, tokenizer=tok, chat_template=tok.chat_template,
                           image_seq_length=GEMMA3_IMAGE_TOKENS)


GEMMA3 = Family(
    specials=("<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
              "<image_soft_token>"),
    eos="<end_of_turn>", pad="<pad>", bos="<bos>",
    named={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    chat=ChatShape(opening="'<start_of_turn>' + ('model' if role == 'assistant' else role) + '\\n'",
                   closing="'<end_of_turn>\\n'", image="<start_of_image>", generation="<start_of_turn>model\n",
                   start="<bos>"),
    config=gemma3_config, processor=gemma3_processor,
    wake={"multi_modal_projector.mm_input_projection_weight": 0.02})


# --------------------------------------------------------------------------- LLaVA (1.5)


def llava_config(spec, tok, side):
    from transformers import LlavaConfig

    vision = vit_fields(spec, side, model_type="clip_vision_model", projection_dim=spec.vision_hidden)
    return LlavaConfig(text_config=dict(model_type="llama", **text_fields(spec, tok)), vision_config=vision,
                       vision_feature_layer=-1, vision_feature_select_strategy="default",
                       tie_word_embeddings=True, **ids(tok, image_token_index="<image>"))


def llava_processor(tok, side):
    from transformers import LlavaImageProcessorPil, LlavaProcessor

    images = LlavaImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=tok.chat_template)


LLAVA = Family(
    specials=("<unk>", "<s>", "</s>", "<image>"), eos="</s>", pad="<unk>", bos="<s>",
    chat=ChatShape(opening="(role | upper) + ': '", closing="'</s>' if role == 'assistant' else ' '",
                   image="<image>\n", generation="ASSISTANT: ", start="<s>"),
    config=llava_config, processor=llava_processor)


# --------------------------------------------------------------------------- LLaVA-NeXT (anyres)


def llava_next_config(spec, tok, side):
    from transformers import LlavaNextConfig

    tile = side // 2
    vision = vit_fields(spec, tile, model_type="clip_vision_model", projection_dim=spec.vision_hidden)
    return LlavaNextConfig(text_config=dict(model_type="mistral", **text_fields(spec, tok)), vision_config=vision,
                           vision_feature_layer=-1, vision_feature_select_strategy="default",
                           image_grid_pinpoints=pinpoints(tile), tie_word_embeddings=True,
                           **ids(tok, image_token_index="<image>"))


def pinpoints(tile: int) -> list[list[int]]:
    """The anyres layouts: one tile, two side by side or stacked, two by two."""
    return [[tile, tile], [tile, 2 * tile], [2 * tile, tile], [2 * tile, 2 * tile]]


def llava_next_processor(tok, side):
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    tile = side // 2
    images = LlavaNextImageProcessorPil(size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile},
                                        image_grid_pinpoints=pinpoints(tile))
    return LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=14,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1,
                              chat_template=tok.chat_template)


LLAVA_NEXT = Family(
    specials=("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "<image>"), eos="</s>", pad="<unk>", bos="<s>",
    chat=ChatShape(opening="'[INST] ' if role == 'user' else ''",
                   closing="' [/INST]' if role == 'user' else '</s>'", image="<image>\n", generation="",
                   start="<s>"),
    config=llava_next_config, processor=llava_next_processor)


# --------------------------------------------------------------------------- InternVL, LLaVA-OneVision


def internvl_config(spec, tok, side):
    from transformers import InternVLConfig

    tile = side // 2
    vision = vit_fields(spec, tile) | {"image_size": [tile, tile], "patch_size": [14, 14]}
    return InternVLConfig(text_config=dict(model_type="qwen2", **text_fields(spec, tok)), vision_config=vision,
                          image_seq_length=internvl_tokens(side), downsample_ratio=0.5, tie_word_embeddings=True,
                          **ids(tok, image_token_id="<IMG_CONTEXT>"))


def internvl_tokens(side: int) -> int:
    """Image tokens per tile: the tile's patches after the 0.5 pixel shuffle."""
    return (side // 2 // 14) ** 2 // 4


def internvl_processor(tok, side):
    from transformers import GotOcr2ImageProcessorPil
    from transformers.models.internvl.processing_internvl import InternVLProcessor

    from vlmrl.models.processing import image_text_processor_class

    tile = side // 2
    images = GotOcr2ImageProcessorPil(size={"height": tile, "width": tile}, crop_to_patches=True, min_patches=1,
                                      max_patches=4)
    return image_text_processor_class(InternVLProcessor)(image_processor=images, tokenizer=tok,
                                                         image_seq_length=internvl_tokens(side),
                                                         chat_template=tok.chat_template)


INTERNVL = Family(
    specials=CHATML + ("<img>", "</img>", "<IMG_CONTEXT>", "<video>"), eos="<|im_end|>", pad="<|endoftext|>",
    named={"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
           "video_token": "<video>"},
    chat=ChatShape(opening=CHATML_SHAPE.opening, closing=CHATML_SHAPE.closing, image="<IMG_CONTEXT>\n",
                   generation=CHATML_SHAPE.generation),
    config=internvl_config, processor=internvl_processor)


def llava_onevision_config(spec, tok, side):
    from transformers import LlavaOnevisionConfig

    tile = side // 2
    vision = vit_fields(spec, tile, model_type="siglip_vision_model")
    return LlavaOnevisionConfig(text_config=dict(model_type="qwen2", **text_fields(spec, tok)), vision_config=vision,
                                vision_feature_layer=-1, vision_feature_select_strategy="full",
                                image_grid_pinpoints=pinpoints(tile), tie_word_embeddings=True,
                                **ids(tok, image_token_index="<image>", video_token_index="<video>"))


def llava_onevision_processor(tok, side):
    from transformers import LlavaOnevisionImageProcessorPil
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    from vlmrl.models.processing import image_text_processor_class

    tile = side // 2
    images = LlavaOnevisionImageProcessorPil(size={"height": tile, "width": tile}, image_grid_pinpoints=pinpoints(tile))
    return image_text_processor_class(LlavaOnevisionProcessor)(
        image_processor=images, tokenizer=tok, num_image_tokens=(tile // 14) ** 2,
        vision_feature_select_strategy="full", chat_template=tok.chat_template)


LLAVA_ONEVISION = Family(
    specials=CHATML + ("<image>", "<video>"), eos="<|im_end|>", pad="<|endoftext|>",
    chat=ChatShape(opening=CHATML_SHAPE.opening, closing=CHATML_SHAPE.closing, image="<image>\n",
                   generation=CHATML_SHAPE.generation, video="<video>\n"),
    config=llava_onevision_config, processor=llava_onevision_processor)


# --------------------------------------------------------------------------- Mistral 3 (Pixtral vision)


def mistral3_config(spec, tok, side):
    from transformers import Mistral3Config

    vision = dict(hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden,
                  num_hidden_layers=spec.vision_depth, num_attention_heads=spec.vision_heads,
                  head_dim=spec.vision_hidden // spec.vision_heads, image_size=side, patch_size=14)
    return Mistral3Config(text_config=dict(model_type="mistral", **text_fields(spec, tok)), vision_config=vision,
                          spatial_merge_size=2, tie_word_embeddings=True, **ids(tok, image_token_index="[IMG]"))


def mistral3_processor(tok, side):
    from vlmrl.models.processing import import_processor_module

    pixtral = "transformers.models.pixtral"
    images = import_processor_module(f"{pixtral}.image_processing_pil_pixtral").PixtralImageProcessorPil(
        size={"longest_edge": side}, patch_size=14)
    processor = import_processor_module(f"{pixtral}.processing_pixtral").PixtralProcessor
    return processor(image_processor=images, tokenizer=tok, patch_size=14, spatial_merge_size=2,
                     chat_template=tok.chat_template)


MISTRAL3 = Family(
    specials=("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"),
    eos="</s>", pad="<unk>", bos="<s>",
    chat=ChatShape(opening="'[INST]' if role == 'user' else ''", closing="'[/INST]' if role == 'user' else '</s>'",
                   image="[IMG]", generation="", start="<s>"),
    config=mistral3_config, processor=mistral3_processor)


# --------------------------------------------------------------------------- Llama 3.2 Vision (mllama)


def mllama_config(spec, tok, side):
    from transformers import MllamaConfig

    text = text_fields(spec, tok, cross_attention_layers=[1])
    text["num_hidden_layers"] = spec.layers + 1  # one more: the cross-attention layer
    vision = dict(hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden,
                  num_hidden_layers=spec.vision_depth, num_global_layers=1, attention_heads=spec.vision_heads,
                  vision_output_dim=2 * spec.vision_hidden, image_size=side // 2, patch_size=14, max_num_tiles=4,
                  intermediate_layers_indices=[0])  # the aspect ratios: the default set for 4 tiles
    return MllamaConfig(text_config=text, vision_config=vision, **ids(tok, image_token_index="<|image|>"))


def mllama_processor(tok, side):
    from transformers import MllamaImageProcessorPil, MllamaProcessor

    images = MllamaImageProcessorPil(size={"height": side // 2, "width": side // 2}, max_image_tiles=4)
    return MllamaProcessor(image_processor=images, tokenizer=tok, chat_template=tok.chat_template)


MLLAMA = Family(
    specials=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
              "<|image|>", "<|python_tag|>", "<|finetune_right_pad_id|>"),
    eos="<|eot_id|>", pad="<|finetune_right_pad_id|>", bos="<|begin_of_text|>",
    chat=ChatShape(opening="'<|start_header_id|>' + role + '<|end_header_id|>\\n\\n'", closing="'<|eot_id|>'",
                   image="<|image|>", generation="<|start_header_id|>assistant<|end_header_id|>\n\n",
                   start="<|begin_of_text|>"),
    config=mllama_config, processor=mllama_processor,
    wake={"cross_attn_attn_gate": 1.0, "cross_attn_mlp_gate": 1.0})  # scalar tanh gates


FAMILIES: dict[str, Family] = {
    "qwen2_5_vl": qwen2_family("qwen2_5_vl"),
    "qwen2_vl": qwen2_family("qwen2_vl"),
    "idefics3": idefics_family("idefics3"),
    "smolvlm": idefics_family("smolvlm"),
    "qwen3_vl": qwen3_family("qwen3_vl"),
    "qwen3_vl_moe": qwen3_family("qwen3_vl_moe"),
    "qwen3_5": qwen3_family("qwen3_5"),
    "glm4v": GLM4V,
    "gemma3": GEMMA3,
    "llava": LLAVA,
    "llava_next": LLAVA_NEXT,
    "internvl": INTERNVL,
    "llava_onevision": LLAVA_ONEVISION,
    "mistral3": MISTRAL3,
    "mllama": MLLAMA,
}
"""Every family `vlmrl tiny-model --arch` builds, in the order `vlmrl models` lists them (the demo's
Qwen2.5-VL first)."""
