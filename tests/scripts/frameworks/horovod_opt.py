"""A Horovod-API script: `import trainaccel.horovod as hvd`, `hvd.DistributedOptimizer` around AdamW, an MLP (no
DDP model); OUT_DIR/rank{r}.json as report.py writes it."""

import torch
from report import STEPS, Recorder, batch, mlp, parse

import trainaccel.horovod as hvd


def main() -> None:
    args = parse()
    hvd.init()
    module = mlp()
    recorder = Recorder(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-2)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=module.named_parameters())
    hvd.broadcast_parameters(module.state_dict(), root_rank=0)
    for step in range(1, STEPS + 1):
        x, y = batch(hvd.rank(), step)
        loss = torch.nn.functional.mse_loss(module(x).float(), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        recorder.loss(loss)
        recorder.at_step(step)
    recorder.finish(None, args.out, optimizer=optimizer)
    hvd.shutdown()


if __name__ == "__main__":
    main()
