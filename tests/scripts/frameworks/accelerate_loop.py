"""A Hugging Face Accelerate loop: `accelerator.prepare(model, optimizer, dataloader)` on CPU, an MLP with AdamW;
OUT_DIR/rank{r}.json as report.py writes it."""

import os

import torch
from report import Recorder, dataset, mlp, parse


def main() -> None:
    args = parse()
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    module = mlp()
    recorder = Recorder(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-2)
    loader = torch.utils.data.DataLoader(dataset(int(os.environ["WORLD_SIZE"])), batch_size=16)
    model, optimizer, loader = accelerator.prepare(module, optimizer, loader)
    model.train()
    step = 0
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        step += 1
        recorder.loss(loss)
        recorder.at_step(step)
    recorder.finish(model, args.out, steps=step)


if __name__ == "__main__":
    main()
