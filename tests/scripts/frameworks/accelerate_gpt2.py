"""A Hugging Face Accelerate loop as language-model users write it: a GPT-2 built from a config (its head tied to the
token embedding), gradient accumulation over 2 micro-batches (`accelerator.accumulate`), AdamW; after training,
`save_state`/`load_state` and safetensors' `save_model`/`load_model` round trips. OUT_DIR/rank{r}.json as report.py
writes it, with what the round trips saw."""

import os
from pathlib import Path

import torch
from report import MID, STEPS, Recorder, parse

ACCUMULATE = 2  # micro-batches per optimizer step


class Sequences(torch.utils.data.Dataset):
    """Counting sequences (i, i+1, ... mod the vocabulary): next-token prediction a tiny model learns in a few steps."""

    def __len__(self) -> int:
        return 4 * ACCUMULATE * STEPS * int(os.environ["WORLD_SIZE"])

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": (torch.arange(16) + i) % 32}


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=2, n_head=2))


def tied(state: dict) -> bool | None:
    """Whether a state dict holds the head and the token embedding as one tensor, as the model holds them (None: an
    empty one, a sharded model's on a rank other than 0)."""
    if not state:
        return None
    return state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()


def round_trips(accelerator, module: torch.nn.Module, recorder: Recorder, folder: Path) -> None:
    """save_state/load_state and safetensors' save_model/load_model, what each saw noted in the report."""
    from safetensors.torch import load_model, save_model

    # A look at the model (under sync_every: the synced model) keeps the module's sharing of Parameters.
    recorder.data["tied_state_dict"] = tied(module.state_dict())
    recorder.data["tied_named_parameters"] = module.lm_head.weight is module.transformer.wte.weight
    accelerator.save_state(folder)  # rank 0 writes the model, in safetensors by default: one tensor per storage
    accelerator.wait_for_everyone()
    accelerator.load_state(folder)  # strict: refuses a key the model does not have
    mine = folder / f"module{accelerator.process_index}.safetensors"
    save_model(module, str(mine))  # on every rank (a sharded model gathers its full state dict on rank 0)
    look = module.state_dict()
    recorder.data["round_trips"] = True
    if look:  # a sharded model's rank other than 0 wrote an empty file
        fresh = gpt2()
        load_model(fresh, str(mine))
        same = torch.equal(fresh.transformer.wte.weight, look["transformer.wte.weight"])
        recorder.data["round_trips"] = tied(fresh.state_dict()) and same


def main() -> None:
    args = parse()
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    module = gpt2()
    recorder = Recorder(module)
    recorder.data["accumulate"] = ACCUMULATE
    optimizer = torch.optim.AdamW(module.parameters(), lr=5e-3)
    loader = torch.utils.data.DataLoader(Sequences(), batch_size=4)
    model, optimizer, loader = accelerator.prepare(module, optimizer, loader)
    model.train()
    step = 0
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            recorder.loss(loss)
            recorder.at_step(step)
            if step == MID:  # between syncs under sync_every 4: a look sees the synced model, not the live one
                round_trips(accelerator, module, recorder, Path(args.out, "state"))
    recorder.finish(model, args.out, steps=step)


if __name__ == "__main__":
    main()
