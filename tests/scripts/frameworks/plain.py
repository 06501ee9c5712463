"""A plain DDP training loop (AdamW, an MLP); OUT_DIR/rank{r}.json as report.py writes it."""

import torch
import torch.distributed as dist
from report import STEPS, Recorder, batch, mlp, parse
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    args = parse()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    module = mlp()
    recorder = Recorder(module)
    model = DDP(module)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for step in range(1, STEPS + 1):
        x, y = batch(dist.get_rank(), step)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        recorder.loss(loss)
        recorder.at_step(step)
    recorder.finish(model, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
