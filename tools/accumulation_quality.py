"""Validation loss of a byte-level GPT-2 trained by a plain Accelerate loop with gradient accumulation, under plain DDP
(torchrun) and under `trainaccel run --sync-every ...` arms (auto, and the settings auto picks fixed by hand).
Driver (default): runs each arm x seed as a subprocess holding /tmp/trainaccel-timed.lock, prints a table.
Worker (`--worker OUT_JSON`): the training script itself, as torchrun or trainaccel run starts it."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONTEXT = 64  # bytes per window
LOCK = "/tmp/trainaccel-timed.lock"
AUTO_LINE = re.compile(r"sync_every=auto: H=.*")
HERE = Path(__file__).resolve()

# arm -> (launcher: None for torchrun (plain DDP), else trainaccel run's flags; the worker's extra arguments)
ARMS: dict[str, tuple[list[str] | None, list[str]]] = {
    "ddp": (None, []),
    "h4": (["--sync-every", "4"], []),
    "auto": (["--sync-every", "auto"], []),
    "h1o1": (["--sync-every", "1", "--sync-overlap", "1"], []),
    "h1": (["--sync-every", "1"], []),
    "h4o1": (["--sync-every", "4", "--sync-overlap", "1"], []),
    "h2": (["--sync-every", "2"], []),
    "h2o1": (["--sync-every", "2", "--sync-overlap", "1"], []),
    "h3": (["--sync-every", "3"], []),
    # The same samples per optimizer step with no accumulation (one micro-batch of 32): what auto then measures.
    "ddp-acc1": (None, ["--acc", "1", "--batch", "32"]),
    "auto-acc1": (["--sync-every", "auto"], ["--acc", "1", "--batch", "32"]),
}
DEFAULT_ARMS = "ddp,h4,auto,h1o1,h1,h4o1,h2"


def worker(args: argparse.Namespace) -> None:
    """The Accelerate training loop as a user writes it; rank 0 writes the validation loss and what trainaccel did."""
    from pydoc_data.topics import topics

    import torch
    from accelerate import Accelerator
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = int(len(data) * 0.9)
    train, held = data[:cut], data[cut:]

    class Windows(torch.utils.data.Dataset):
        """Every offset of the training text is a window of CONTEXT bytes."""

        def __len__(self) -> int:
            return len(train) - CONTEXT

        def __getitem__(self, i: int) -> torch.Tensor:
            return train[i : i + CONTEXT]

    accelerator = Accelerator(gradient_accumulation_steps=args.acc, cpu=True)
    torch.manual_seed(args.seed)  # the same initial model on every rank and in every arm of a seed
    config = GPT2Config(
        vocab_size=256, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    samples = args.steps * args.acc * args.batch * accelerator.num_processes
    sampler = torch.utils.data.RandomSampler(
        Windows(), num_samples=samples, generator=torch.Generator().manual_seed(1000 + args.seed)
    )
    loader = torch.utils.data.DataLoader(Windows(), batch_size=args.batch, sampler=sampler)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # each rank: its share of the batches
    model.train()
    steps = micro = 0
    curve, summed = [], 0.0  # each optimizer step's mean training loss over its micro-steps (this rank's)
    began = time.perf_counter()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        micro += 1
        summed += float(loss.detach())
        if accelerator.sync_gradients:
            steps += 1
            curve.append(round(summed / args.acc, 4))
            summed = 0.0
    trained_s = time.perf_counter() - began
    result = {"steps": steps, "micro_steps": micro, "train_s": trained_s, "train_losses": curve}
    observer = getattr(model, "trainaccel", None)
    diloco = getattr(observer, "diloco", None) if observer is not None else None
    if diloco is not None:
        import trainaccel.comm  # noqa: F401 (trainaccel's features, loaded as the existing tests do)

        result["diloco"] = {"steps": diloco.steps, "syncs": diloco.syncs, "interval": diloco.interval}
        auto = getattr(diloco.outer, "_auto", None)
        if auto is not None and auto.setting is not None:
            result["auto_setting"] = auto.setting.line()
    if accelerator.is_main_process:
        # Validation windows spread over the held-out text; the unwrapped model in eval mode (under sync_every: the
        # synced model, which trainaccel shows to an evaluation forward).
        starts = torch.linspace(0, len(held) - CONTEXT - 1, 64 * 32).long()
        windows = held[starts[:, None] + torch.arange(CONTEXT)]
        module = accelerator.unwrap_model(model)
        module.eval()
        total = 0.0
        with torch.no_grad():
            for chunk in windows.split(32):
                total += float(module(input_ids=chunk, labels=chunk).loss)
        result["val_loss"] = total / len(windows.split(32))
        result["rank"] = accelerator.process_index
        Path(args.worker).write_text(json.dumps(result))
    accelerator.wait_for_everyone()
    accelerator.end_training()


def run_arm(arm: str, seed: int, args: argparse.Namespace, logs: Path) -> dict:
    """One arm on one seed as a subprocess under the timed lock: its JSON result, wall seconds and auto's lines."""
    launcher, extra = ARMS[arm]
    out = logs / f"{arm}-s{seed}.json"
    out.unlink(missing_ok=True)
    worker_args = [str(HERE), "--worker", str(out), "--seed", str(seed), "--steps", str(args.steps)]
    worker_args += ["--lr", str(args.lr), *extra]
    start = ["--standalone", "--nproc-per-node", "2"]
    if launcher is None:
        command = [sys.executable, "-m", "torch.distributed.run", *start, *worker_args]
    else:
        command = [sys.executable, "-m", "trainaccel", "run", *start, *launcher, *worker_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # Under the lock, the shell prints when it got it: the wall seconds leave out the wait for the lock.
    locked = ["flock", LOCK, "sh", "-c", 'echo "locked at $(date +%s.%N)"; exec "$@"', "sh", *command]
    done = subprocess.run(locked, capture_output=True, text=True, env=env)
    wall = time.time() - float(re.search(r"locked at ([\d.]+)", done.stdout).group(1))
    output = done.stdout + done.stderr
    (logs / f"{arm}-s{seed}.log").write_text(" ".join(command) + "\n" + output)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"{arm} seed {seed} failed ({done.returncode}):\n{output[-4000:]}")
    result = json.loads(out.read_text())
    result.update(arm=arm, seed=seed, wall_s=wall, command=" ".join(command))
    result["auto_lines"] = list(dict.fromkeys(m.group(0) for m in AUTO_LINE.finditer(output)))
    return result


def table(results: list[dict]) -> str:
    base = {r["seed"]: r["val_loss"] for r in results if r["arm"] == "ddp"}
    base1 = {r["seed"]: r["val_loss"] for r in results if r["arm"] == "ddp-acc1"}
    for r in results:
        ref = (base1 if r["arm"].endswith("acc1") and base1 else base).get(r["seed"])
        r["vs_ddp_pct"] = 100 * (r["val_loss"] / ref - 1) if ref else None
    lines = [f"{'arm':<10} {'seed':>4} {'val loss':>9} {'vs DDP':>8} {'wall s':>7} {'train s':>7} {'syncs':>6}  auto"]
    for r in results:
        vs = f"{r['vs_ddp_pct']:+.2f}%" if r["vs_ddp_pct"] is not None else "-"
        syncs = r.get("diloco", {}).get("syncs", "-")
        auto = " | ".join(r["auto_lines"])
        lines.append(
            f"{r['arm']:<10} {r['seed']:>4} {r['val_loss']:>9.4f} {vs:>8} {r['wall_s']:>7.1f} {r['train_s']:>7.1f} "
            f"{syncs:>6}  {auto}"
        )
    lines.append("")
    lines.append(f"{'arm':<10} {'seeds':>5} {'median loss':>11} {'median vs DDP':>13} {'per seed vs DDP':<40}")
    for arm in dict.fromkeys(r["arm"] for r in results):
        mine = [r for r in results if r["arm"] == arm]
        pct = [r["vs_ddp_pct"] for r in mine if r["vs_ddp_pct"] is not None]
        med = f"{statistics.median(pct):+.2f}%" if pct else "-"
        each = ", ".join(f"{p:+.2f}" for p in pct)
        loss = statistics.median(r["val_loss"] for r in mine)
        lines.append(f"{arm:<10} {len(mine):>5} {loss:>11.4f} {med:>13} {each:<40}")
    return "\n".join(lines)


def driver(args: argparse.Namespace) -> None:
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; known: {', '.join(ARMS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    logs = Path(args.logs or tempfile.mkdtemp(prefix="accumulation-quality-"))
    logs.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in seeds:
        for arm in arms:
            result = run_arm(arm, seed, args, logs)
            results.append(result)
            auto = f" {result['auto_lines'][-1]}" if result["auto_lines"] else ""
            syncs = result.get("diloco", {}).get("syncs", "-")
            print(
                f"{arm} seed {seed}: val {result['val_loss']:.4f}, {result['wall_s']:.1f} s, syncs {syncs}{auto}",
                flush=True,
            )
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
    print(table(results))
    print(f"logs: {logs}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="OUT_JSON", help="run as the training script, writing its result here")
    parser.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated, of: {', '.join(ARMS)}")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (data order and initial model)")
    parser.add_argument("--json", help="write every run's result here")
    parser.add_argument("--logs", help="folder for each run's output and JSON (default: a new one under /tmp)")
    parser.add_argument("--seed", type=int, default=0, help="worker: the seed")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps")
    parser.add_argument("--acc", type=int, default=4, help="worker: micro-steps per optimizer step")
    parser.add_argument("--batch", type=int, default=8, help="worker: windows per micro-step and rank")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate, the same in every arm")
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
