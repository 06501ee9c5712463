import pytest
import torch

from trainaccel.bench.models import MODELS, get_model

# torchvision's published parameter counts for these architectures.
TORCHVISION_PARAMETERS = {"resnet18": 11_689_512, "resnet50": 25_557_032, "resnext50_32x4d": 25_028_904}


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(TORCHVISION_PARAMETERS))
def test_resnet_parameter_counts_match_torchvision(name):
    assert _count(get_model(name).build()) == TORCHVISION_PARAMETERS[name]


@pytest.mark.parametrize("name", sorted(TORCHVISION_PARAMETERS))
def test_matches_torchvision_layer_by_layer_when_present(name):
    models = pytest.importorskip("torchvision.models")
    ours = {k: tuple(v.shape) for k, v in get_model(name).build().state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in getattr(models, name)().state_dict().items()}
    assert ours == theirs


def test_mlp_is_bandwidth_heavy():
    spec = get_model("mlp")
    assert 18_500_000 <= _count(spec.build()) <= 19_500_000
    assert spec.example_shape(224) == (1024,)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_on_small_inputs(name):
    spec = get_model(name)
    out = spec.build()(torch.randn(2, *spec.example_shape(32)))
    assert out.shape == (2, spec.num_classes)


def test_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match="invalid model 'vgg'; accepted: resnet18, resnet50, resnext50_32x4d, mlp"):
        get_model("vgg")
