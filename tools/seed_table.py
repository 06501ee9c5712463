"""Per-seed figures of a `trainaccel bench quality --json` run: each arm's share of the ceiling and its validation loss
against plain DDP's, seed by seed, with their medians.

    python tools/seed_table.py RUN.json [--baseline BASELINE.json]

The share pairs each repeat's `local` arm (the ceiling) with the arm's repeat of the same seed; the loss pairs the
arm's final validation loss with the `baseline` arm's (plain DDP) of the same seed, from RUN or, where RUN left plain
DDP out for time, from BASELINE: its losses are deterministic per seed, so a run of the same task, steps, batch and
validations gives them. Repeat i is seed i in both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

SAME = ("task", "steps", "batch_size", "eval_every")  # the settings a baseline's losses depend on
BASELINE = "baseline"
CEILINGS = ("node-local", "local")  # a replica per node's ceiling where it ran, else no exchange at all


def workers(run: dict) -> str:
    """The run's workers as nodes x workers per node (its emulated cluster's, or one machine's local workers)."""
    settings = run["settings"]
    spec = dict(item.split("=", 1) for item in (settings.get("emulate") or "").split(",") if "=" in item)
    if "nodes" in spec:
        return f"{spec['nodes']}x{spec.get('procs-per-node', 1)}"
    return f"1x{settings.get('nproc_per_node')}"


# What plain DDP's per-seed losses depend on: the settings, the workers, and the CPU's kernels (AVX2 and AVX-512 sum in
# different orders: the same seed ends elsewhere).
_SAME_GETTERS = {
    **{key: (lambda run, key=key: run["settings"].get(key)) for key in SAME},
    "workers": workers,
    "cpu_capability": lambda run: run.get("machine", {}).get("cpu_capability"),
}


def final_losses(arm: dict) -> list[float]:
    """Each repeat's validation loss at its last step (its curve's last point: step, seconds, loss, accuracy)."""
    return [curve[-1][2] for curve in arm["curves"]]


def rows(run: dict, baseline: dict | None = None) -> list[dict]:
    """One row per arm of `run` other than the ceiling and plain DDP: its per-seed share and loss ratio, and medians."""
    arms = run["arms"]
    base = arms.get(BASELINE)
    if base is None and baseline is not None:
        for key, get in _SAME_GETTERS.items():
            if get(baseline) != get(run):
                raise ValueError(
                    f"the baseline's {key}={get(baseline)!r} differs from the run's {get(run)!r}; accepted: a run "
                    f"of the same {', '.join(_SAME_GETTERS)}"
                )
        base = baseline["arms"].get(BASELINE)
        if base is None:
            raise ValueError(f"the baseline run has no {BASELINE!r} arm; its arms: {', '.join(baseline['arms'])}")
    found = []
    ceiling = next((name for name in CEILINGS if name in arms), None)
    for name, arm in arms.items():
        if name in (*CEILINGS, BASELINE):
            continue
        row: dict = {"arm": name}
        if ceiling is not None:
            row["share"] = [c / s for c, s in zip(arms[ceiling]["seconds"], arm["seconds"], strict=True)]
        if base is not None:
            mine, theirs = final_losses(arm), final_losses(base)
            if len(theirs) < len(mine):
                raise ValueError(
                    f"the baseline has {len(theirs)} seeds, the run {len(mine)}; accepted: at least as many"
                )
            row["loss"] = [m / t - 1 for m, t in zip(mine, theirs)]
        found.append(row)
    return found


def table(found: list[dict]) -> str:
    """The rows as Markdown lines: per-seed percentages, then the median in bold."""
    lines = []
    for row in found:
        for key, label, sign in (("share", "of the ceiling", ""), ("loss", "loss vs plain DDP", "+")):
            if key in row:
                seeds = " | ".join(f"{x:{sign}.1%}" for x in row[key])
                lines.append(f"| {row['arm']}: {label} | {seeds} | **{statistics.median(row[key]):{sign}.1%}** |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a bench quality --json file")
    parser.add_argument("--baseline", help="a run of the same task with a baseline arm, where RUN has none")
    args = parser.parse_args(argv)
    with open(args.run) as f:
        run = json.load(f)
    baseline = None
    if args.baseline:
        with open(args.baseline) as f:
            baseline = json.load(f)
    try:
        print(table(rows(run, baseline)))
    except ValueError as error:
        print(f"seed_table: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
