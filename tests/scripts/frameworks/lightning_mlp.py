"""Lightning `L.Trainer(accelerator="cpu", strategy="ddp")` training an MLP with AdamW, no logger, checkpoint or
progress bar; OUT_DIR/rank{r}.json as report.py writes it."""

import os

import torch
from report import STEPS, Recorder, dataset, mlp, parse


def main(validate: bool = False) -> None:
    """`validate`: a validation loop too (Lightning's sanity check first, then every 4 steps), as most scripts have."""
    args = parse()
    import lightning as L

    recorder = None

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
            recorder.loss(loss)
            return loss

        def validation_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-2)

    class Observe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.ddp = trainer.strategy.model  # the DDP model Lightning built

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            recorder.at_step(trainer.global_step)

    module = Module()
    recorder = Recorder(module)
    observe = Observe()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=per_node,
        num_nodes=int(os.environ["WORLD_SIZE"]) // per_node,
        strategy="ddp",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=2 if validate else 0,
        val_check_interval=4 if validate else None,
        limit_val_batches=2,
        default_root_dir=os.path.join(args.out, "lightning"),
        callbacks=[observe],
    )
    loader = torch.utils.data.DataLoader(dataset(int(os.environ["WORLD_SIZE"])), batch_size=16)
    trainer.fit(module, loader, loader if validate else None)
    sampler = trainer.train_dataloader.sampler  # the DistributedSampler Lightning built for the whole job
    recorder.data["sampler"] = type(sampler).__name__
    recorder.data["sampler_after"] = [int(i) for i in sampler]  # a pass after training: the split of the workers now
    recorder.finish(observe.ddp, args.out)


if __name__ == "__main__":
    main()
