"""trainaccel beside torchft from one `trainaccel bench quality --json` run: each arm's time, time to plain DDP's loss
+ 1%, loss and bytes; torchft's best settings; whether `auto` reached each one's loss in at most half its time; and
whether trainaccel at a torchft arm's setting ended bit for bit where torchft did.

    python tools/peer_table.py RUN.json [--same LABEL=TORCHFT_LABEL ...]

torchft's arms are `torchft` and every `torchft-*` variant; its best are the one with the lowest median final
validation loss and the one soonest to plain DDP's loss + 1% in the median (of those reaching it in every repeat). A
trainaccel variant `same-X` is paired with `torchft-X` (or name the pairs with --same). Repeats are seeds: each figure
is paired by repeat, then the median taken.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

BASELINE, AUTO = "baseline", "auto"
CEILINGS = ("node-local", "local")  # a replica per node's ceiling where it ran, else no exchange at all
GOAL = 0.5  # auto reaches torchft's best loss in at most this share of torchft's time
# The table's quality mark: plain DDP's loss + 1%, not the bench's own target (its JSON's `tolerance`, 2%)
TARGET = 0.01


def time_to(curve: list[list[float]], target: float) -> float | None:
    """Training seconds at the first validation after step 0 whose loss is at most `target` (the bench's rule)."""
    return next((seconds for step, seconds, loss, _ in curve if step > 0 and loss <= target), None)


def is_torchft(arm: str) -> bool:
    return arm == "torchft" or arm.startswith("torchft-")


def _median(values: list[float | None]) -> float | None:
    return statistics.median(values) if values and all(v is not None for v in values) else None


def median_final_loss(arm: dict) -> float:
    return statistics.median(curve[-1][2] for curve in arm["curves"])


def ceiling_of(arms: dict) -> str | None:
    return next((name for name in CEILINGS if name in arms), None)


def rows(run: dict) -> list[dict]:
    """Per arm: median seconds, seconds to plain DDP's loss + TARGET, final loss, share of the ceiling, MiB sent."""
    arms, steps = run["arms"], run["settings"]["steps"]
    base, ceiling = arms.get(BASELINE), ceiling_of(arms)
    found = []
    for name, arm in arms.items():
        row = {
            "arm": name,
            "seconds": arm["median_seconds"],
            "loss": median_final_loss(arm),
            "mib": None if arm.get("bytes_per_step") is None else arm["bytes_per_step"] * steps / 2**20,
        }
        if base is not None:
            targets = [curve[-1][2] * (1 + TARGET) for curve in base["curves"]]
            reached = [time_to(curve, t) for curve, t in zip(arm["curves"], targets, strict=True)]
            row["to_target"], row["reached"] = _median(reached), sum(r is not None for r in reached)
            pairs = zip(arm["curves"], base["curves"], strict=True)
            row["vs_baseline"] = statistics.median(a[-1][2] / b[-1][2] - 1 for a, b in pairs)
        if ceiling is not None and name != ceiling:
            pairs = zip(arms[ceiling]["seconds"], arm["seconds"], strict=True)
            row["share"] = statistics.median(c / s for c, s in pairs)
        found.append(row)
    return found


def best_torchft(run: dict) -> str:
    """The torchft arm with the lowest median final validation loss; ValueError if the run has none."""
    peers = [name for name in run["arms"] if is_torchft(name)]
    if not peers:
        raise ValueError(f"the run has no torchft arm; its arms: {', '.join(run['arms'])}")
    return min(peers, key=lambda name: median_final_loss(run["arms"][name]))


def fastest_torchft(found: list[dict]) -> str | None:
    """The torchft arm that reached plain DDP's loss + TARGET soonest in the median, of those that reached it in
    every repeat (None: none did)."""
    reached = [row for row in found if is_torchft(row["arm"]) and row.get("to_target") is not None]
    return min(reached, key=lambda row: row["to_target"])["arm"] if reached else None


def against_best(run: dict, best: str, arm: str = AUTO) -> dict:
    """`arm`'s seconds to reach `best`'s final loss of the same repeat against `best`'s own seconds to it."""
    if arm not in run["arms"]:
        raise ValueError(f"the run has no {arm!r} arm; its arms: {', '.join(run['arms'])}")
    ratios, times, below = [], [], 0
    for mine, theirs in zip(run["arms"][arm]["curves"], run["arms"][best]["curves"], strict=True):
        target = theirs[-1][2]
        took, own = time_to(mine, target), time_to(theirs, target)
        times.append((took, own))
        ratios.append(None if took is None or not own else took / own)
        below += mine[-1][2] < target
    ratio = _median(ratios)
    gap = median_final_loss(run["arms"][arm]) / median_final_loss(run["arms"][best]) - 1
    return {"times": times, "ratio": ratio, "met": ratio is not None and ratio <= GOAL, "gap": gap, "below": below}


def same_pairs(run: dict, named: list[str]) -> list[tuple[str, str]]:
    """(trainaccel arm, torchft arm) pairs at one setting: `same-X` with `torchft-X`, and the pairs `named`."""
    pairs = [(n, "torchft-" + n[len("same-") :]) for n in run["arms"] if n.startswith("same-")]
    for text in named:
        mine, _, theirs = text.partition("=")
        pairs.append((mine, theirs))
    for mine, theirs in pairs:
        for arm in (mine, theirs):
            if arm not in run["arms"]:
                raise ValueError(f"no arm {arm!r} to pair ({mine}={theirs}); the run's arms: {', '.join(run['arms'])}")
    return pairs


def bit_for_bit(run: dict, mine: str, theirs: str) -> tuple[int, int, float]:
    """Repeats whose every validation loss is equal in both arms, repeats, and the largest relative difference."""
    equal, worst = 0, 0.0
    pairs = list(zip(run["arms"][mine]["curves"], run["arms"][theirs]["curves"], strict=True))
    for a, b in pairs:
        losses = [(p[2], q[2]) for p, q in zip(a, b, strict=True)]
        equal += all(x == y for x, y in losses)
        worst = max([worst, *(abs(x / y - 1) for x, y in losses)])
    return equal, len(pairs), worst


def table(run: dict, named: list[str] = ()) -> str:
    """The Markdown table and the lines under it."""

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} s"

    repeats = run["settings"]["repeats"]
    lines = [
        "| arm | seconds | to plain DDP's loss + 1% | validation loss | vs plain DDP | of the ceiling | MiB sent |",
        "|---|---|---|---|---|---|---|",
    ]
    found = rows(run)
    for row in found:
        reached = row.get("reached")
        to = "-" if reached is None else seconds(row["to_target"])
        if reached is not None and reached < repeats:
            to = f"{reached} of {repeats} reached"
        lines.append(
            f"| {row['arm']} | {row['seconds']:.1f} s | {to} | {row['loss']:.4f} | "
            + ("-" if "vs_baseline" not in row else f"{row['vs_baseline']:+.1%}")
            + f" | {'-' if 'share' not in row else format(row['share'], '.0%')} | "
            + f"{'-' if row['mib'] is None else format(row['mib'], '.1f')} |"
        )
    lines.append("")
    best, fastest = best_torchft(run), fastest_torchft(found)
    for what, name in (("lowest loss", best), ("fastest to plain DDP's loss + 1%", fastest)):
        if name is None:
            lines.append(f"torchft's {what}: none reached it in every repeat")
            continue
        if what != "lowest loss" and name == best:
            lines.append(f"torchft's {what}: {name}, its lowest loss too")
            continue
        line = f"torchft's {what}: {name}"
        if AUTO in run["arms"]:
            got = against_best(run, name)
            each = ", ".join("not reached" if a is None else f"{a:.1f} s vs {b:.1f} s" for a, b in got["times"])
            verdict = (
                "did not reach its loss"
                if got["ratio"] is None
                else f"reached its loss in {got['ratio']:.2f}x its time"
            )
            line += f"; auto {verdict} (goal {GOAL}x: {'met' if got['met'] else 'missed'}; {each})"
            line += (
                f"; auto's median loss {got['gap']:+.1%} against it, below it in {got['below']} of {len(got['times'])}"
            )
            own = statistics.median(b for _, b in got["times"])
            top = ceiling_of(run["arms"])
            if top is not None and own and run["arms"][top]["median_seconds"] > GOAL * own:
                share = run["arms"][top]["median_seconds"] / own
                line += f"; no arm can meet it: the ceiling's whole run took {share:.2f}x its time"
        lines.append(line)
    for mine, theirs in same_pairs(run, list(named)):
        equal, total, worst = bit_for_bit(run, mine, theirs)
        lines.append(
            f"{mine} vs {theirs}: equal at every validation in {equal} of {total} repeats (most apart {worst:.2e})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a bench quality --json file with torchft arms")
    parser.add_argument("--same", action="append", default=[], metavar="MINE=THEIRS", help="arms at one setting")
    args = parser.parse_args(argv)
    with open(args.run) as f:
        run = json.load(f)
    try:
        print(table(run, args.same))
    except ValueError as error:
        print(f"peer_table: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
