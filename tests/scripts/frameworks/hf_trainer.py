"""Hugging Face `transformers.Trainer` on CPU (DDP through accelerate) training a tiny GPT-2 built from a config, on an
in-memory data set; OUT_DIR/rank{r}.json as report.py writes it."""

import os

import torch
from report import STEPS, Recorder, parse


class Sequences(torch.utils.data.Dataset):
    """Counting sequences (i, i+1, ... mod the vocabulary): next-token prediction a tiny model learns in a few steps."""

    def __len__(self) -> int:
        return 8 * STEPS * int(os.environ["WORLD_SIZE"])

    def __getitem__(self, i: int) -> dict:
        ids = (torch.arange(16) + i) % 32
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    args = parse()
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    recorder = Recorder(model)
    model.register_forward_hook(lambda m, a, out: recorder.loss(out.loss) if m.training else None)

    class AfterStep(TrainerCallback):
        def on_step_end(self, training_args, state, control, **kwargs):
            recorder.at_step(state.global_step)

    training_args = TrainingArguments(
        output_dir=os.path.join(args.out, "trainer"),
        max_steps=STEPS,
        per_device_train_batch_size=8,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        use_cpu=True,
        ddp_backend="gloo",
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=Sequences(), callbacks=[AfterStep()])
    trainer.train()
    recorder.finish(trainer.model_wrapped, args.out)


if __name__ == "__main__":
    main()
