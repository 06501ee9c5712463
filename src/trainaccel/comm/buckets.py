"""Per-bucket state of the engine, held for the parameters a bucket holds rather than for its index.

DDP numbers its buckets, and renumbers them when it rebuilds them (after the first iteration,
and again in a restarted job). What a codec keeps for a bucket (residuals, randomk's round,
PowerSGD's factors) is stored under the bucket's index for speed, and follows its parameters:
when the parameters at an index change, every bucket's state is parked under its parameters and
picked up again by whichever index holds them next. A loaded checkpoint arrives parked.
"""

from __future__ import annotations

from typing import Any

Signature = tuple  # the indices, in the model's `parameters()` order, of the parameters one bucket holds

LOCAL_STORES = (
    "residual",
    "velocity",
    "inter_residual",
    "inter_velocity",
    "intra_residual",
    "intra_velocity",
    "powersgd_error",
)
"""Stores that hold what this rank alone knows (its own gradients' residuals); the others are equal on every rank."""


def bucket_stores(state: Any) -> dict[str, dict]:
    """Every dict of `state` (a CommState) keyed by bucket index, or by (bucket index, chunk), by name."""
    stores: dict[str, dict] = {}
    for prefix, feedback in (
        ("", state.feedback),
        *(
            (("inter_", state.hierarchy.feedback), ("intra_", state.hierarchy.intra_feedback))
            if state.hierarchy is not None
            else ()
        ),
    ):
        if feedback is not None:
            stores[f"{prefix}residual"], stores[f"{prefix}velocity"] = feedback.residuals, feedback.velocities
    for prefix, codec in (("", state.codec), ("intra_", getattr(state.hierarchy, "intra_codec", None))):
        for store in ("rounds", "scales"):  # randomk's round, a dynamic fp16 scale
            values = getattr(codec, store, None)
            if values is not None:
                stores[f"{prefix}{store}"] = values
        adaptive = getattr(codec, "adaptive", None)
        if adaptive is not None:  # an adaptive ratio's current ratio
            stores[f"{prefix}ratios"] = adaptive.ratios
    if state.powersgd is not None:
        powersgd = state.powersgd
        stores["powersgd_error"] = powersgd.error_dict
        stores["powersgd_p"], stores["powersgd_q"] = powersgd.p_memory_dict, powersgd.q_memory_dict
    return stores


def split_key(key: Any) -> tuple[int, Any]:
    """(bucket index, the rest) of a store's key: `3` -> (3, None), `(3, 1)` -> (3, 1)."""
    return (key[0], key[1]) if isinstance(key, tuple) else (key, None)


def join_key(index: int, rest: Any) -> Any:
    return index if rest is None else (index, rest)


def park_all(state: Any) -> None:
    """Move every bucket's state out of the index-keyed stores, under its bucket's parameters."""
    for name, store in bucket_stores(state).items():
        for key in list(store):
            index, rest = split_key(key)
            signature = state.signatures.get(index)
            value = store.pop(key)
            if signature is not None:
                state.parked.setdefault(signature, {}).setdefault(name, {})[rest] = value
    state.signatures.clear()


def follow_bucket(state: Any, index: int, signature: Signature) -> None:
    """Before bucket `index` is reduced: make its stores hold the state of the parameters it holds now.

    Call on the communication thread, which is the only one that touches the stores.
    """
    held = state.signatures.get(index)
    if held == signature:
        return
    if held is not None:  # DDP rebuilt its buckets: every index may hold other parameters now
        park_all(state)
    state.signatures[index] = signature
    parked = state.parked.pop(signature, None)
    if parked:
        stores = bucket_stores(state)
        for name, entries in parked.items():
            if name in stores:
                for rest, value in entries.items():
                    stores[name][join_key(index, rest)] = value


def holds_state_for(state: Any, index: int, signature: Signature) -> bool:
    """Whether state is kept for exactly these parameters (at `index`, or parked from a rebuild or a checkpoint)."""
    return state.signatures.get(index) == signature or signature in state.parked
