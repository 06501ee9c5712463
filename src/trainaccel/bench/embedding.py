"""`trainaccel bench embedding`: lookups/s of embedding training steps, and a collision and memory check.

Every arm trains the same Criteo-shaped batches (26 one-id features, Zipf keys) with Adagrad in this
process: forward, backward and the update. Arms:
baseline     per-feature nn.EmbeddingBag, dense gradients, torch.optim.Adagrad (what one writes first)
torch-sparse per-feature nn.EmbeddingBag(sparse=True), torch.optim.Adagrad on sparse gradients
trainaccel   one DynamicEmbedding keyed by (feature, id), SparseAdagrad
torchrec     TorchRec's FusedEmbeddingBagCollection (fbgemm's fused CPU kernels), when installed
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from trainaccel.bench.jobs import report_header
from trainaccel.bench.progress import progress
from trainaccel.bench.recsys import NUM_SPARSE, CriteoSynthetic, feature_keys

ARMS = ("baseline", "torch-sparse", "trainaccel", "torchrec")
EPS = 1e-8  # fbgemm's Adagrad default; every arm uses it so that the updates are the same


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=4096, help="examples per step, 26 ids each (default 4096)")
    parser.add_argument("--dim", type=int, default=16, help="embedding dim (default 16)")
    parser.add_argument(
        "--max-rows", type=int, default=100_000, help="rows per feature table, Criteo's sizes capped (default 100000)"
    )
    parser.add_argument("--alpha", type=float, default=1.2, help="Zipf exponent of the ids (default 1.2)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per repeat (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed first steps per arm (default 5)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each arm, interleaved (default 5)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {', '.join(ARMS)}")
    parser.add_argument(
        "--insert-keys",
        type=int,
        default=1_000_000,
        help="distinct random keys for the collision and memory check (0 skips it; default 1000000)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")


def _check(args: argparse.Namespace) -> list[str]:
    for flag in ("batch_size", "dim", "max_rows", "steps", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"invalid --{flag.replace('_', '-')} {getattr(args, flag)}; accepted: an integer >= 1")
    for flag in ("warmup", "threads", "insert_keys"):
        if getattr(args, flag) < 0:
            raise ValueError(f"invalid --{flag.replace('_', '-')} {getattr(args, flag)}; accepted: an integer >= 0")
    if not args.alpha > 1:
        raise ValueError(f"invalid --alpha {args.alpha}; accepted: a number > 1")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ARMS for a in arms) or len(set(arms)) != len(arms):
        raise ValueError(f"invalid --arms {args.arms!r}; accepted: a comma-separated subset of {', '.join(ARMS)}")
    return arms


def torchrec_available() -> str | None:
    """None when TorchRec's fused CPU kernels import, else why not."""
    import importlib

    try:
        importlib.import_module("torchrec.modules.fused_embedding_modules")
    except Exception as e:  # ImportError, or fbgemm's own errors when its build does not match torch
        return f"{type(e).__name__}: {e}"
    return None


Step = Callable[[torch.Tensor], None]


def _bag_arm(cards: list[int], dim: int, lr: float, sparse: bool) -> Step:
    bags = nn.ModuleList(nn.EmbeddingBag(c, dim, mode="sum", sparse=sparse) for c in cards)
    optimizer = torch.optim.Adagrad(bags.parameters(), lr=lr, eps=EPS)
    offsets = None

    def step(ids: torch.Tensor) -> None:
        nonlocal offsets
        if offsets is None or offsets.numel() != ids.shape[0]:
            offsets = torch.arange(ids.shape[0])
        out = torch.stack([bag(ids[:, i], offsets) for i, bag in enumerate(bags)], 1)
        optimizer.zero_grad(set_to_none=True)
        out.sum().backward()
        optimizer.step()

    return step


def _trainaccel_arm(dim: int, lr: float) -> Step:
    from trainaccel.embedding import DynamicEmbedding, SparseAdagrad

    table = DynamicEmbedding(dim)
    optimizer = SparseAdagrad(table, lr=lr, eps=EPS)

    def step(ids: torch.Tensor) -> None:
        table(feature_keys(ids)).sum().backward()
        optimizer.step()

    return step


def _torchrec_arm(cards: list[int], dim: int, lr: float) -> Step:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=dim, num_embeddings=c, feature_names=[f"f{i}"], pooling=PoolingType.SUM
        )
        for i, c in enumerate(cards)
    ]
    # The update runs inside backward (fused); TorchRec's CPU path has Adagrad but no Adam.
    collection = FusedEmbeddingBagCollection(
        tables=tables,
        optimizer_type=torch.optim.Adagrad,
        optimizer_kwargs={"lr": lr, "eps": EPS},
        device=torch.device("cpu"),
    )
    names = [f"f{i}" for i in range(len(cards))]

    def step(ids: torch.Tensor) -> None:
        kjt = KeyedJaggedTensor(
            keys=names, values=ids.T.reshape(-1), lengths=torch.ones(ids.numel(), dtype=torch.int32)
        )
        collection(kjt).values().sum().backward()

    return step


def time_arms(arms: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Lookups/s per arm: median of interleaved repeats, each `steps` steps after the arm's warm-up."""
    data = CriteoSynthetic(seed=0, alpha=args.alpha, max_rows=args.max_rows)
    batches = [data.batch(args.batch_size, i).sparse for i in range(8)]
    lr = 0.01
    builders = {
        "baseline": lambda: _bag_arm(data.cardinalities, args.dim, lr, sparse=False),
        "torch-sparse": lambda: _bag_arm(data.cardinalities, args.dim, lr, sparse=True),
        "trainaccel": lambda: _trainaccel_arm(args.dim, lr),
        "torchrec": lambda: _torchrec_arm(data.cardinalities, args.dim, lr),
    }
    steps, done = {}, {arm: 0 for arm in arms}
    for arm in arms:
        steps[arm] = builders[arm]()
        for _ in range(args.warmup):
            steps[arm](batches[done[arm] % len(batches)])
            done[arm] += 1
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    with progress("bench embedding", args.repeats * len(arms)) as report:
        for repeat in range(args.repeats):
            for arm in arms:  # interleaved: drift on a shared machine hits every arm alike
                report.start(f"{arm}, repeat {repeat + 1}/{args.repeats}")
                start = time.perf_counter()
                for _ in range(args.steps):
                    steps[arm](batches[done[arm] % len(batches)])
                    done[arm] += 1
                rates[arm].append(args.batch_size * NUM_SPARSE * args.steps / (time.perf_counter() - start))
                report.done(f"{rates[arm][-1] / 1e6:.2f} M lookups/s")
    results = {}
    for arm, r in rates.items():
        results[arm] = {"lookups_per_s": r, "median": statistics.median(r), "min": min(r), "max": max(r)}
        for other in ("torchrec", "baseline"):
            if other in rates and other != arm:
                results[arm][f"ratio_vs_{other}"] = statistics.median(a / b for a, b in zip(r, rates[other]))
    return results


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def insert_check(keys_total: int, dim: int, batch: int = 100_000) -> dict:
    """Insert distinct random keys in batches; every key must read back its own row; memory vs the payload."""
    from trainaccel.embedding import DynamicEmbedding, SparseAdagrad, initializers

    g = torch.Generator().manual_seed(0)
    keys = torch.randint(-(2**63), 2**63 - 1, (int(keys_total * 1.01) + 16,), generator=g).unique()
    keys = keys[torch.randperm(keys.numel(), generator=g)[:keys_total]]
    if keys.numel() < keys_total:
        raise RuntimeError(f"drew {keys.numel()} distinct keys, wanted {keys_total}")
    rss_before = _rss_bytes()
    table = DynamicEmbedding(dim)
    SparseAdagrad(table)  # its per-row state counts in the payload
    start = time.perf_counter()
    for chunk in keys.split(batch):
        table.rows_for(chunk)
        table.take_gradients()
    elapsed = time.perf_counter() - start
    rss_after = _rss_bytes()
    table.eval()
    rows = table._find_rows(keys)
    own_rows = bool((rows >= 0).all()) and torch.unique(rows).numel() == keys_total
    init = initializers.normal()
    own_values = all(
        torch.equal(table.weight.index_select(0, r), init(k, dim))
        for k, r in zip(keys.split(1_000_000), rows.split(1_000_000))
    )
    payload = keys_total * dim * 4 * 2  # rows + Adagrad's sum, float32
    return {
        "keys": keys_total,
        "dim": dim,
        "rows": len(table),
        "every_key_has_its_own_row": own_rows,
        "every_row_holds_its_keys_initial_value": own_values,
        "inserts_per_s": keys_total / elapsed,
        "table_bytes": table.memory_bytes(),
        "payload_bytes": payload,
        "table_vs_payload": table.memory_bytes() / payload,
        "rss_growth_bytes": rss_after - rss_before,
        "rss_growth_vs_payload": (rss_after - rss_before) / payload,
    }


def _isolated_insert_check(keys_total: int, dim: int) -> dict:
    """`insert_check` in a fresh process: its RSS is its own, and its 10M-key heap does not slow the arms."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(insert_check, keys_total, dim).result()


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    try:
        arms = _check(args)
    except ValueError as e:
        print(f"trainaccel bench embedding: error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    skipped = {}
    if "torchrec" in arms and (why := torchrec_available()) is not None:
        skipped["torchrec"] = why
        arms.remove("torchrec")
    console = Console(width=max(100, Console().width))
    check = _isolated_insert_check(args.insert_keys, args.dim) if args.insert_keys else None
    # torch.optim.Adagrad builds sparse tensors without checking them and says so at every step.
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
    results = time_arms(arms, args) if arms else {}
    title = (
        f"bench embedding: batch {args.batch_size} x {NUM_SPARSE} ids, dim {args.dim}, "
        f"<= {args.max_rows} rows per feature, "
        f"Zipf {args.alpha}, Adagrad, {torch.get_num_threads()} threads, median of {args.repeats}"
    )
    table = Table(title=title)
    for column in ("arm", "lookups/s", "min - max", "vs torchrec", "vs baseline"):
        table.add_column(column, justify="left" if column == "arm" else "right")
    for arm, r in results.items():
        table.add_row(
            arm,
            f"{r['median'] / 1e6:.2f} M",
            f"{r['min'] / 1e6:.2f} - {r['max'] / 1e6:.2f} M",
            *(f"{r[k]:.2f}x" if k in r else "-" for k in ("ratio_vs_torchrec", "ratio_vs_baseline")),
        )
    console.print(table)
    for arm, why in skipped.items():
        console.print(f"{arm}: not run ({why}); see docs/embedding.md for installing it")
    if check:
        console.print(
            f"{check['keys']:,} distinct keys inserted, dim {check['dim']}: "
            f"own rows {check['every_key_has_its_own_row']}, "
            f"own values {check['every_row_holds_its_keys_initial_value']}, "
            f"{check['inserts_per_s'] / 1e6:.2f} M inserts/s, "
            f"table {check['table_bytes'] / 2**20:.0f} MiB = {check['table_vs_payload']:.2f}x rows + Adagrad state "
            f"(RSS grew {check['rss_growth_vs_payload']:.2f}x)"
        )
    if args.json:
        report = {
            **report_header("embedding", args),
            "threads": torch.get_num_threads(),
            "arms": results,
            "skipped": skipped,
            "insert_check": check,
        }
        Path(args.json).write_text(json.dumps(report, indent=2))
    if check and not (check["every_key_has_its_own_row"] and check["every_row_holds_its_keys_initial_value"]):
        print("trainaccel bench embedding: error: keys collided", file=sys.stderr)
        return 1
    return 0
