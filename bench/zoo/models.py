"""The zoo's models: architectures people deploy, built with random weights from a
fixed seed and exported to ONNX by either of PyTorch's exporters.

Each entry is a `ZooModel`: a name, its family, the exporter (`script`: the
TorchScript exporter, `dynamo`: `torch.onnx.export(dynamo=True)`), a function that
builds the `torch.nn.Module` (in eval mode) and one that makes its example inputs.
Nothing here downloads weights: torchvision models are built with `weights=None`,
transformers models from a config written here.
"""

from dataclasses import dataclass
from typing import Callable

SEED = 0


@dataclass(frozen=True)
class ZooModel:
    name: str
    family: str
    exporter: str  # "script" or "dynamo"
    build: Callable
    inputs: Callable  # () -> dict of name -> tensor
    opset: int = 17


def _randn(name, *dims):
    """Example inputs: one standard normal tensor from the fixed seed."""

    def make():
        import torch

        g = torch.Generator().manual_seed(SEED)
        return {name: torch.randn(*dims, generator=g)}

    return make


def _image(size=224, batch=1, channels=3):
    return _randn("pixels", batch, channels, size, size)


def _tokens(seq=128, vocab=1000, mask=True, types=False):
    def make():
        import torch

        g = torch.Generator().manual_seed(SEED)
        feeds = {"input_ids": torch.randint(0, vocab, (1, seq), generator=g)}
        if mask:
            feeds["attention_mask"] = torch.ones(1, seq, dtype=torch.int64)
        if types:
            feeds["token_type_ids"] = torch.zeros(1, seq, dtype=torch.int64)
        return feeds

    return make


def _tv(name, **kwargs):
    """A torchvision classification or video model with random weights."""

    def build():
        import torchvision

        return torchvision.models.get_model(name, weights=None, **kwargs)

    return build


def _tv_seg(name):
    def build():
        import torchvision

        return torchvision.models.get_model(name, weights=None, weights_backbone=None, aux_loss=False)

    return build


class _Unet:
    """A small U-Net: two downsampling stages, two `ConvTranspose2d` upsamplings with
    skip concatenations, batch norm and ReLU (the shape of segmentation nets users
    write themselves)."""

    @staticmethod
    def build():
        import torch
        from torch import nn

        def block(i, o):
            return nn.Sequential(
                nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(),
                nn.Conv2d(o, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(),
            )

        class Unet(nn.Module):
            def __init__(self):
                super().__init__()
                self.e1, self.e2, self.e3 = block(3, 32), block(32, 64), block(64, 128)
                self.pool = nn.MaxPool2d(2)
                self.u2 = nn.ConvTranspose2d(128, 64, 2, stride=2)
                self.d2 = block(128, 64)
                self.u1 = nn.ConvTranspose2d(64, 32, 2, stride=2)
                self.d1 = block(64, 32)
                self.head = nn.Conv2d(32, 2, 1)

            def forward(self, x):
                a = self.e1(x)
                b = self.e2(self.pool(a))
                c = self.e3(self.pool(b))
                y = self.d2(torch.cat([self.u2(c), b], 1))
                y = self.d1(torch.cat([self.u1(y), a], 1))
                return self.head(y)

        return Unet()


def _fpn():
    """A detection backbone: ResNet-18 stages under a feature pyramid (nearest
    `Resize` upsampling and adds), as the detectors' backbones are built."""
    from torchvision.models import resnet18
    from torchvision.models.detection.backbone_utils import BackboneWithFPN

    return BackboneWithFPN(
        resnet18(weights=None),
        return_layers={"layer1": "0", "layer2": "1", "layer3": "2", "layer4": "3"},
        in_channels_list=[64, 128, 256, 512],
        out_channels=128,
    )


def _hf(config_fn, model_cls, wrap=None):
    def build():
        import transformers

        config = config_fn(transformers)
        model = getattr(transformers, model_cls)(config)
        return wrap(model) if wrap else model

    return build


class _FirstOutput:
    """Wraps a transformers model so that export sees one tensor out (its last hidden
    state, or logits), and keyword inputs in a fixed order."""

    def __new__(cls, model, keys):
        from torch import nn

        class Wrapped(nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, *args):
                out = self.model(**dict(zip(keys, args)), return_dict=True)
                return out[0]

        return Wrapped()


def _text(keys):
    return lambda model: _FirstOutput(model, keys)


def _clip_text(t):
    return t.CLIPTextConfig()


def _clip_vision(t):
    return t.CLIPVisionConfig()


def _whisper(t):
    return t.WhisperConfig(
        d_model=384, encoder_layers=4, encoder_attention_heads=6, decoder_layers=1,
        decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536,
    )


def _gpt2(t):
    return t.GPT2Config(n_layer=6)


def _t5(t):
    return t.T5Config(d_model=512, d_ff=2048, num_layers=6, num_heads=8)


def _wav2vec2(t):
    return t.Wav2Vec2Config(num_hidden_layers=6)


def _audio(samples=16000):
    return _randn("input_values", 1, samples)


def _mels():
    return _randn("input_features", 1, 80, 3000)


def _video():
    return _randn("clip", 1, 3, 8, 112, 112)


def _whisper_encoder(model):
    return _FirstOutput(model.get_encoder(), ["input_features"])


def _t5_encoder(model):
    return _FirstOutput(model.get_encoder(), ["input_ids", "attention_mask"])


MASKED = ["input_ids", "attention_mask"]
TYPED = ["input_ids", "attention_mask", "token_type_ids"]

MODELS = [
    # Classic and mobile CNNs.
    ZooModel("resnet18", "cnn", "script", _tv("resnet18"), _image()),
    ZooModel("resnet50", "cnn", "dynamo", _tv("resnet50"), _image(), 18),
    ZooModel("mobilenet_v2", "cnn", "script", _tv("mobilenet_v2"), _image()),
    ZooModel("mobilenet_v3_large", "cnn", "dynamo", _tv("mobilenet_v3_large"), _image(), 18),
    ZooModel("efficientnet_b0", "cnn", "script", _tv("efficientnet_b0"), _image()),
    ZooModel("regnet_y_400mf", "cnn", "dynamo", _tv("regnet_y_400mf"), _image(), 18),
    ZooModel("convnext_tiny", "cnn", "script", _tv("convnext_tiny"), _image()),
    ZooModel("densenet121", "cnn", "script", _tv("densenet121"), _image()),
    ZooModel("shufflenet_v2", "cnn", "dynamo", _tv("shufflenet_v2_x1_0"), _image(), 18),
    ZooModel("squeezenet", "cnn", "script", _tv("squeezenet1_1"), _image()),
    # Vision transformers.
    ZooModel("vit_b_16", "vit", "dynamo", _tv("vit_b_16"), _image(), 18),
    ZooModel("swin_t", "vit", "script", _tv("swin_t"), _image()),
    # Segmentation with upsampling.
    ZooModel("deeplabv3_mobilenet", "segmentation", "script", _tv_seg("deeplabv3_mobilenet_v3_large"), _image(256)),
    ZooModel("fcn_resnet50", "segmentation", "dynamo", _tv_seg("fcn_resnet50"), _image(256), 18),
    ZooModel("unet", "segmentation", "dynamo", _Unet.build, _image(256), 18),
    ZooModel("lraspp_mobilenet", "segmentation", "script", _tv_seg("lraspp_mobilenet_v3_large"), _image(256)),
    # Detection backbones.
    ZooModel("resnet18_fpn", "detection", "script", _fpn, _image(320)),
    # Text encoders.
    ZooModel("bert", "text", "script", _hf(lambda t: t.BertConfig(), "BertModel", _text(TYPED)), _tokens(types=True)),
    ZooModel("roberta", "text", "dynamo", _hf(lambda t: t.RobertaConfig(), "RobertaModel", _text(MASKED)), _tokens(), 18),
    ZooModel("distilbert", "text", "script", _hf(lambda t: t.DistilBertConfig(), "DistilBertModel", _text(MASKED)), _tokens()),
    # Decoders.
    ZooModel("gpt2", "decoder", "script", _hf(_gpt2, "GPT2LMHeadModel", _text(MASKED)), _tokens()),
    # Encoder-decoders.
    ZooModel("t5_encoder", "encoder-decoder", "dynamo", _hf(_t5, "T5Model", _t5_encoder), _tokens(), 18),
    # Audio.
    ZooModel("whisper_encoder", "audio", "script", _hf(_whisper, "WhisperModel", _whisper_encoder), _mels()),
    ZooModel("wav2vec2", "audio", "script", _hf(_wav2vec2, "Wav2Vec2Model", _text(["input_values"])), _audio()),
    # CLIP towers.
    ZooModel("clip_text", "clip", "script", _hf(_clip_text, "CLIPTextModel", _text(MASKED)), _tokens(seq=77)),
    ZooModel("clip_vision", "clip", "dynamo", _hf(_clip_vision, "CLIPVisionModel", _text(["pixel_values"])), _image(), 18),
    # Video.
    ZooModel("r3d_18", "video", "script", _tv("r3d_18"), _video()),
]


def by_name():
    return {m.name: m for m in MODELS}
