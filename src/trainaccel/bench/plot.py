"""`--plot PATH` for the benchmarks: matplotlib, an optional extra (`pip install trainaccel[plot]`)."""

from __future__ import annotations

import textwrap
from pathlib import Path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'trainaccel[plot]'") from None
    return plt


def check_available() -> None:
    """Fail before any benchmark runs, not after, when plotting cannot work."""
    _pyplot()


def plot_train(summary: dict[str, dict], title: str, path: str | Path) -> None:
    """Bar per arm: median examples/s per worker, whiskers from min to max."""
    plt = _pyplot()
    arms = list(summary)
    medians = [summary[a]["median"] for a in arms]
    low = [summary[a]["median"] - summary[a]["min"] for a in arms]
    high = [summary[a]["max"] - summary[a]["median"] for a in arms]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(arms)), 4))
    palette = ["#888888", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#d62728", "#8c564b"]
    ax.bar(arms, medians, yerr=[low, high], capsize=6, color=[palette[i % len(palette)] for i in range(len(arms))])
    ax.set_ylabel("examples/s per worker (median, min-max)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_comm(rows: list[dict], title: str, path: str | Path) -> None:
    """Bus bandwidth against message size, one line per codec, with the link's rate if known."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for codec in dict.fromkeys(r["compression"] for r in rows):
        mine = [r for r in rows if r["compression"] == codec]
        ax.plot([r["size_bytes"] for r in mine], [r["busbw_gbit_s"] for r in mine], marker="o", label=codec)
    link = rows[0].get("link_gbit_s") if rows else None
    if link:
        ax.axhline(link, linestyle="--", color="gray", label="link")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (Gbit/s)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# Each built-in arm in words, for a reader who has not run the benchmark.
ARM_WORDS = {
    "baseline": "plain DDP",
    "torch-fp16": "DDP + torch's fp16_compress_hook",
    "torch-bf16": "DDP + torch's bf16_compress_hook",
    "local": "no communication (the ceiling)",
    "node-local": "no exchange across nodes (a node's ceiling)",
}


# Arms run by another project, at the options the trainaccel arm is given.
PEER_WORDS = {"torchft": "torchft's DiLoCo"}


def arm_words(arm: str, options: dict[str, str] | None = None) -> str:
    """An arm's line in a legend: built-in arms in words, trainaccel's as the flags that start them, a peer's by
    name with the options it runs at."""
    if arm in ARM_WORDS:
        return ARM_WORDS[arm]
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in (options or {}).items())
    peer = PEER_WORDS.get(arm.partition("-")[0])  # a peer's arm, or its variant (torchft-LABEL)
    return f"{peer or 'trainaccel run'} {flags}".strip()


def plot_quality(
    summary: dict[str, dict], title: str, path: str | Path, options: dict[str, dict[str, str]] | None = None
) -> None:
    """Validation loss against training seconds, one line per arm (its first repeat, named in words), the target
    dashed; `options`: each trainaccel arm's options, which name it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm, s in summary.items():
        curve = s["curves"][0]
        label = arm_words(arm, (options or {}).get(arm))
        ax.plot([c[1] for c in curve], [c[2] for c in curve], marker=".", label=label, linewidth=1.5)
    targets = next((s["target_loss"] for s in summary.values() if s.get("target_loss") is not None), None)
    target = targets[0] if targets else None  # the first repeat's, as the curves are
    if target is not None:
        ax.axhline(target, linestyle="--", color="gray", label="plain DDP's final loss + 2%")
    ax.set_xlabel("training seconds")
    ax.set_ylabel("validation loss")
    ax.set_title(textwrap.fill(title, 90), fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
