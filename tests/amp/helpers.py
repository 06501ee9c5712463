"""What the AMP tests share."""

import torch
from torch.nn.utils import clip_grad
from torch.optim import lr_scheduler


def patchable() -> dict[str, object]:
    """What zero-code AMP patches: Tensor.backward, the clipping functions, the schedulers' step."""
    found = {"Tensor.backward": vars(torch.Tensor)["backward"]}
    for module in (torch.nn.utils, clip_grad):
        found.update(
            {
                f"{module.__name__}.{name}": value
                for name, value in vars(module).items()
                if "clip" in name or "total_norm" in name
            }
        )
    for name, cls in vars(lr_scheduler).items():
        if isinstance(cls, type) and "step" in vars(cls):
            found[f"{name}.step"] = vars(cls)["step"]
    return found
