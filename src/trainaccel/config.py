"""One configuration for trainaccel: keyword > `trainaccel run` flag > TRAINACCEL_* env > default.

`trainaccel run` passes its flags to the workers as TRAINACCEL_* variables, so a flag
overrides whatever the environment held, and a keyword to `trainaccel.init()` overrides both.
This module must stay free of torch so that `import trainaccel` is cheap.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any, Callable

ENV_PREFIX = "TRAINACCEL_"
# TRAINACCEL_* variables that are not options (no keyword, no flag), by lower-case name: what each does.
# Read each through `env_setting()`; `Config.unknown_env()` knows them, so they are not reported as typos.
ENV_SETTINGS: dict[str, str] = {
    "heartbeat_dir": "folder where each worker also writes its heartbeat for its node's `trainaccel run`, which ends "
    "a worker that stopped beating (set by `trainaccel run`)",
    "check_owners": "1: fail at once when a second thread issues collectives on a process group another thread "
    "issues on (a debug check of the engine's one issuing thread per group; see docs/operations.md)",
    "elastic_dir": "folder of hvd.elastic's commit files (default: one per torchrun job in the temp dir); "
    "a relaunch with the same folder resumes from the newest commit",
    **{
        f"{group}_full": f"1: the test suite runs its {group} cases outside the CI subset too "
        f"(`pytest -m {group}_full`, tests/conftest.py)"
        for group in ("bench", "comm", "resilience", "frameworks")
    },
    "unknown_env": "warn: a TRAINACCEL_* variable that names no option or setting is reported and ignored (default: "
    "an error, which names the closest option: a misspelt option would silently train without it)",
}


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """` (did you mean X?)` for the known name closest to a misspelt `name`, or `` when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


class ConfigError(ValueError):
    """An option got a value it does not accept; the message is one line."""

    def __init__(self, option: str, value: Any, accepted: str, source: str | None = None):
        self.option, self.value, self.accepted, self.source = option, value, accepted, source
        where = f" (from {source})" if source else ""
        super().__init__(f"invalid {option}={value!r}{where}; accepted: {accepted}")

    @classmethod
    def line(cls, message: str) -> ConfigError:
        """A configuration error that is not one option's value (an unknown name): `message` as is."""
        error = cls.__new__(cls)
        error.option = error.value = error.accepted = error.source = None
        ValueError.__init__(error, message)
        return error


def _choice(
    *choices: str, aliases: Mapping[str, str] | None = None, booleans: tuple[str, str] | None = None
) -> Callable[[str, Any], str]:
    """Parser for an option that takes one of `choices` or an alias of one (case-insensitive)."""

    aliases = dict(aliases or {})
    accepted = ", ".join([*choices, *(a.upper() for a in aliases)])

    def parse(name: str, raw: Any) -> str:
        if isinstance(raw, bool) and booleans is not None:
            return booleans[0] if raw else booleans[1]
        value = str(raw).strip().lower()
        value = aliases.get(value, value)
        if value not in choices:
            raise ConfigError(name, raw, accepted)
        return value

    parse.accepted = accepted  # type: ignore[attr-defined]
    literal = "Literal[" + ", ".join(f'"{c}"' for c in [*choices, *(a.upper() for a in aliases)]) + "]"
    parse.annotation = f"{literal} | bool" if booleans else literal  # type: ignore[attr-defined]
    return parse


def _positive_float_or_unset(name: str, raw: Any) -> float | None:
    if raw is None or (isinstance(raw, str) and raw.strip() == ""):
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(name, raw, _positive_float_or_unset.accepted) from None  # type: ignore[attr-defined]
    if isinstance(raw, bool) or not value > 0 or value == float("inf"):
        raise ConfigError(name, raw, _positive_float_or_unset.accepted)  # type: ignore[attr-defined]
    return value


_positive_float_or_unset.accepted = "a number > 0 (MiB)"  # type: ignore[attr-defined]
_positive_float_or_unset.annotation = "float"  # type: ignore[attr-defined]


def _path_or_unset(name: str, raw: Any) -> str | None:
    if raw is None or (isinstance(raw, str) and raw.strip() == ""):
        return None
    if not isinstance(raw, (str, os.PathLike)):
        raise ConfigError(name, raw, _path_or_unset.accepted)  # type: ignore[attr-defined]
    return os.fspath(raw)


_path_or_unset.accepted = "a file path (empty: off)"  # type: ignore[attr-defined]
_path_or_unset.annotation = "str | os.PathLike[str]"  # type: ignore[attr-defined]


def _number(
    kind: type, low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> Callable[[str, Any], Any]:
    """Parser for an int or float in [low, high] (open at either end with `low_open` / `high_open`)."""

    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    interval = None if high == float("inf") else interval
    noun = "an integer" if kind is int else "a number"
    accepted = f"{noun} in {interval}" if interval else f"{noun} {'>' if low_open else '>='} {low:g}"

    def parse(name: str, raw: Any) -> Any:
        try:
            if isinstance(raw, bool):
                raise ValueError
            value = kind(raw.strip()) if isinstance(raw, str) else kind(raw)
            if kind is int and not isinstance(raw, str) and value != raw:
                raise ValueError  # 2.5 is not an integer
        except (TypeError, ValueError):
            raise ConfigError(name, raw, accepted) from None
        below = low < value if low_open else low <= value
        above = value < high if high_open else value <= high
        if not below or not above or value == float("inf"):
            raise ConfigError(name, raw, accepted)
        return value

    parse.accepted = accepted  # type: ignore[attr-defined]
    parse.annotation = kind.__name__  # type: ignore[attr-defined]
    return parse


def _keyword_or(
    keyword: str | tuple[str, ...], number: Callable[[str, Any], Any], accepted: str
) -> Callable[[str, Any], Any]:
    """Parser for an option that takes `keyword` (or one of several; case-insensitive) or what `number` parses."""
    keywords = (keyword,) if isinstance(keyword, str) else keyword

    def parse(name: str, raw: Any) -> Any:
        if isinstance(raw, str) and raw.strip().lower() in keywords:
            return raw.strip().lower()
        try:
            return number(name, raw)
        except ConfigError:
            raise ConfigError(name, raw, accepted) from None

    parse.accepted = accepted  # type: ignore[attr-defined]
    parse.annotation = "Literal[" + ", ".join(f'"{k}"' for k in keywords) + "] | " + number.annotation  # type: ignore[attr-defined]
    return parse


_fp16_scale = _keyword_or(
    ("auto", "dynamic", "peak"),
    _number(float, 0.0, float("inf"), low_open=True),
    "auto, dynamic, peak, or a number > 0 (a fixed scale)",
)


STORE_SCHEME = "etcd://"


def parse_endpoints(url: str) -> list[tuple[str, int]]:
    """`etcd://host:port,host:port,...` -> [(host, port), ...]; ValueError naming the value otherwise."""
    accepted = "accepted: etcd://HOST:PORT[,HOST:PORT...] (the etcd members' client addresses, usually port 2379)"
    if not url.startswith(STORE_SCHEME) or not url[len(STORE_SCHEME) :].strip(","):
        raise ValueError(f"invalid store {url!r}; {accepted}")
    endpoints = []
    for part in url[len(STORE_SCHEME) :].split(","):
        host, sep, port = part.strip().rpartition(":")
        host = host.strip("[]")  # an IPv6 address in brackets
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"invalid store member {part!r} in {url!r}; {accepted}")
        endpoints.append((host, int(port)))
    if len(set(endpoints)) != len(endpoints):
        raise ValueError(f"invalid store {url!r}: a member is named twice; {accepted}")
    return endpoints


def store_url(endpoints: Iterable[tuple[str, int]]) -> str:
    """[(host, port), ...] -> `etcd://host:port,...` (an IPv6 host in brackets): what `parse_endpoints` reads."""
    return STORE_SCHEME + ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in endpoints)


def _store(name: str, raw: Any) -> str:
    text = str(raw).strip() if raw is not None else "agent"
    if text in ("", "agent"):
        return "agent"
    try:
        return store_url(parse_endpoints(text))
    except ValueError:
        raise ConfigError(name, raw, _store.accepted) from None


_store.accepted = "agent, or etcd://HOST:PORT[,HOST:PORT...] (the etcd members' client addresses)"  # type: ignore[attr-defined]
_store.annotation = 'Literal["agent"] | str'  # type: ignore[attr-defined]
_store.metavar = "{agent}|etcd://HOST:PORT,..."  # type: ignore[attr-defined]


def _ratio_or_unset(name: str, raw: Any) -> float | None:
    if raw is None or (isinstance(raw, str) and raw.strip() == ""):
        return None
    try:
        return _number(float, 0.0, 1.0, low_open=True)(name, raw)
    except ConfigError:
        raise ConfigError(name, raw, _ratio_or_unset.accepted) from None  # type: ignore[attr-defined]


_ratio_or_unset.accepted = "a number in (0, 1], or empty (off)"  # type: ignore[attr-defined]
_ratio_or_unset.annotation = "float"  # type: ignore[attr-defined]


_momentum = _keyword_or("auto", _number(float, 0.0, 1.0), "auto, or a number in [0, 1]")


_steps_or_auto = _keyword_or("auto", _number(int, 0, float("inf")), "an integer >= 0, or auto")


def _amp_policy(name: str, raw: Any) -> str:
    value = str(raw).strip()
    if value.lower() in ("", "always"):
        return "always"
    from trainaccel.amp.policy import zero_code_policy  # torch is loaded only for a policy other than always

    try:
        zero_code_policy(value)
    except ValueError as e:
        raise ConfigError(name, raw, f"{_amp_policy.accepted}; here: {e}") from None  # type: ignore[attr-defined]
    return value


_amp_policy.accepted = "always, auto[:setting=value,...] or time[:setting=value,...]"  # type: ignore[attr-defined]
_amp_policy.annotation = "str"  # type: ignore[attr-defined]


def _metavar(annotation: str) -> str:
    """A flag's placeholder from its parser's annotation: `{a,b}` for choices, N for integers, X for numbers."""
    words = {"int": "N", "float": "X", "str": "VALUE", "str | os.PathLike[str]": "PATH"}
    literal = re.match(r"Literal\[(.*?)\](?: \| (.*))?$", annotation)
    if not literal:
        return words[annotation]
    choices = "{" + ",".join(c.strip().strip('"') for c in literal.group(1).split(",")) + "}"
    rest = literal.group(2)
    return choices if rest in (None, "bool") else f"{choices}|{words[rest]}"


def _option(
    default: Any,
    parse: Callable[[str, Any], Any],
    help: str,
    *,
    aliases: tuple[str, ...] = (),
    switch: str | None = None,
) -> Any:
    """A Config field; `aliases` are extra command-line flags, `switch` the value a bare flag sets."""
    return dataclasses.field(
        default=default, metadata={"parse": parse, "help": help, "aliases": aliases, "switch": switch}
    )


# `trainaccel run --help` and docs/options.md show the options by what they act on, in this order; each option in one.
TOPICS: dict[str, tuple[str, ...]] = {
    "per-step communication": (
        "compression",
        "intra_compression",
        "hierarchical",
        "compression_ratio",
        "compression_ratio_max",
        "compression_momentum",
        "compression_warmup",
        "fp16_scale",
        "powersgd_rank",
        "local_steps",
        "bucket_mb",
        "autotune",
    ),
    "low-communication training": (
        "sync_every",
        "sync_scope",
        "sync_warmup",
        "sync_fragments",
        "sync_overlap",
        "outer_optimizer",
        "outer_lr",
        "outer_momentum",
        "outer_compression",
    ),
    "sharding": ("shard", "shard_min_params"),
    "precision and compile": ("amp", "amp_policy", "compile", "compile_preset"),
    "monitoring": ("metrics_every", "straggler_every", "straggler_threshold", "timeline", "log_level"),
    "faults": ("on_lost_replica", "store", "nan_check", "collective_timeout", "hang_timeout"),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """Resolved trainaccel options; construct with `Config.resolve()` to read the environment."""

    compression: str = _option(
        "none",
        _choice("none", "fp16", "bf16", "topk", "randomk", "powersgd"),
        "gradient compression across nodes (over all workers when the reduction is flat)",
    )
    intra_compression: str = _option(
        "none",
        _choice("none", "fp16", "bf16"),
        "compression within a node when the reduction is hierarchical",
    )
    hierarchical: str = _option(
        "auto",
        _choice("auto", "on", "off", booleans=("on", "off")),
        "two-level allreduce: reduce-scatter in the node, allreduce across nodes, all-gather in the node; "
        "auto: on with Gloo, >1 node, >1 worker per node and a dense codec (none, fp16, bf16)",
    )
    compression_ratio: float = _option(
        0.01,
        _number(float, 0.0, 1.0, low_open=True),
        "fraction of gradient elements that topk and randomk send each step",
    )
    compression_ratio_max: float | None = _option(
        None,
        _ratio_or_unset,
        "with a value above compression_ratio, topk's and randomk's ratio adapts between the two: raised while "
        "error feedback holds back many steps of gradient, lowered when it holds back few (empty: fixed ratio)",
    )
    compression_momentum: float | str = _option(
        "auto",
        _momentum,
        "momentum correction for topk and randomk; auto: an SGD optimizer's momentum and weight decay are "
        "taken over by error feedback (the optimizer runs without them); a number: DGC's momentum with factor "
        "masking, for a momentum-free optimizer (e.g. 0.9)",
    )
    compression_warmup: int = _option(
        20,
        _number(int, 0, float("inf")),
        "first steps reduced exactly before topk, randomk or powersgd start (at least 1, and 2 for powersgd)",
    )
    fp16_scale: float | str = _option(
        "auto",
        _fp16_scale,
        "gradients are multiplied by this before the fp16 cast and divided after; dynamic: halved after an "
        "overflow, doubled after 2000 steps without one, per bucket; peak: from the largest magnitude over the "
        "workers, per sum, with no host read; auto: peak on GPUs, dynamic on the CPU",
    )
    powersgd_rank: int = _option(
        2,
        _number(int, 1, float("inf")),
        "rank of PowerSGD's low-rank gradient approximation",
    )
    local_steps: int = _option(
        1,
        _number(int, 1, float("inf")),
        "backward passes accumulated locally between gradient exchanges (trainaccel.comm.LocalSteps)",
    )
    sync_every: int | str = _option(
        0,
        _steps_or_auto,
        "low-communication training (DiLoCo): the per-step gradient exchange is off, each worker's optimizer "
        "steps alone, and every N optimizer steps the parameter changes are averaged and applied by an outer "
        "optimizer (0: off, gradients are exchanged every step; auto: N, at most 4 at the peak learning rate and "
        "4 x the square root of its drop from the peak as a schedule lowers it, and sync_fragments, sync_overlap "
        "and outer_compression where left at their defaults, chosen from the measured step and link)",
    )
    sync_scope: str = _option(
        "auto",
        _choice("auto", "node", "rank"),
        "what one replica is under sync_every: node (the workers of a node still average gradients every step, "
        "as DDP does, and the nodes' replicas sync every sync_every steps, as DiLoCo's islands), rank (every "
        "worker steps alone); auto: node for a DDP model over more than one node with the same number (>1) of "
        "workers each, else rank",
    )
    sync_warmup: int = _option(
        0,
        _number(int, 0, float("inf")),
        "first inner steps under sync_every that still exchange gradients every step (as plain DDP); the "
        "local steps and syncs begin after them",
    )
    sync_fragments: int = _option(
        1,
        _number(int, 1, float("inf")),
        "under sync_every, the parameters in this many fragments of about equal size, each synced every "
        "sync_every steps at its own staggered step (Streaming DiLoCo): the same bytes, in smaller and more "
        "frequent syncs",
    )
    sync_overlap: int = _option(
        0,
        _number(int, 0, float("inf")),
        "under sync_every, optimizer steps a sync's exchange runs behind training before its result is applied "
        "(the steps taken meanwhile are kept on top of it); 0: each sync waits for its exchange",
    )
    on_lost_replica: str = _option(
        "stop",
        _choice("stop", "continue"),
        "what the other replicas do when one dies, hangs or is cut off: stop (every node's job ends, as under plain "
        "DDP) or continue (they leave it out and train on: under sync_every from the next sync, else from the step "
        "whose gradient exchange it missed, which they do again among themselves)",
    )
    store: str = _option(
        "agent",
        _store,
        "where the job's store lives (rendezvous, heartbeats, the roll call): agent (torchrun's, in the first node's "
        "agent: losing that node ends the job) or etcd://HOST:PORT,... (an etcd cluster of 3 or 5 members: the job "
        "outlives any node while a majority of them answers, and with --nnodes MIN:MAX nodes join it; needs "
        "--rdzv-id)",
    )
    outer_optimizer: str = _option(
        "average",
        _choice("average", "nesterov", "sgd"),
        "the update applied at each sync of sync_every: average (the replicas' mean; outer_lr and outer_momentum "
        "unused), nesterov (SGD with Nesterov momentum on the averaged change, as DiLoCo's long runs), sgd "
        "(heavy-ball momentum)",
    )
    outer_lr: float = _option(
        0.7,
        _number(float, 0.0, float("inf"), low_open=True),
        "learning rate of sync_every's nesterov and sgd outer steps (1 with outer_momentum 0: plain averaging)",
    )
    outer_momentum: float = _option(
        0.9,
        _number(float, 0.0, 1.0, high_open=True),
        "momentum of sync_every's nesterov and sgd outer steps",
    )
    outer_compression: str = _option(
        "none",
        _choice("none", "bf16", "fp16", "int8", "fp4"),
        "codec of the parameter change that sync_every's syncs average, with error feedback where lossy "
        "(int8 and fp4: per block of 256 values, one float32 scale)",
    )
    shard: str = _option(
        "off",
        _choice("off", "full", "hybrid"),
        "shard every DDP model with FSDP2 instead (parameters, gradients and optimizer state split across ranks): "
        "full over every rank; hybrid within each node, whole replicas reduced across nodes (where compression "
        "fp16 or bf16 applies)",
    )
    shard_min_params: int = _option(
        1_000_000,
        _number(int, 1, float("inf")),
        "under shard, each submodule holding at least this many parameters (not in a smaller one) is gathered "
        "and freed on its own; the rest with the root",
    )
    autotune: str = _option(
        "off",
        _choice("off", "on", booleans=("on", "off")),
        "time candidate fusion sizes, codecs and hierarchy over the first steps and keep the fastest",
    )
    bucket_mb: float | None = _option(
        None,
        _positive_float_or_unset,
        "DDP bucket size in MiB, used unless the script passes bucket_cap_mb (default: DDP's own)",
    )
    amp: str = _option(
        "off",
        _choice("off", "bf16", "fp16", "on", aliases={"o0": "off", "o1": "on"}, booleans=("on", "off")),
        "run every DDP model's forward under autocast: bf16, fp16 (needs trainaccel.amp.scaled(optimizer)), "
        "on (bf16 where the hardware computes it: CPUs, A100/H100 and later GPUs; fp16 on older GPUs, which "
        "needs scaled() too); O0/O1 are aliases of off/on",
        aliases=("--amp-level",),
    )
    amp_policy: str = _option(
        "always",
        _amp_policy,
        "when to autocast: always, or a per-step PrecisionPolicy such as auto or time:start=1000,end=50000",
    )
    compile: str = _option(
        "off",
        _choice("off", "on", booleans=("on", "off")),
        "compile every DDP model with torch.compile after its first step (eager if the toolchain is missing)",
        switch="on",
    )
    compile_preset: str = _option(
        "default",
        _choice("default", "reduce-overhead", "max-autotune"),
        "torch.compile mode used with compile=on",
    )
    nan_check: str = _option(
        "off",
        _choice("off", "warn", "raise", booleans=("raise", "off")),
        "check reduced gradients (under sync_every: each sync's averaged parameter change) for NaN/Inf: off, warn "
        "(log the parameters) or raise",
    )
    metrics_every: int = _option(
        0,
        _number(int, 0, float("inf")),
        "log throughput, step time (data wait vs compute) and peak memory every N training steps on rank 0 (0: off)",
    )
    straggler_every: int = _option(
        0,
        _number(int, 0, float("inf")),
        "every N training steps, compare the workers' own step times and name those slower than the median (0: off)",
    )
    straggler_threshold: float = _option(
        0.2,
        _number(float, 0.0, float("inf"), low_open=True),
        "how much slower than the median a worker's own step time must be to be named (0.2: 20 percent)",
    )
    timeline: str | None = _option(
        None,
        _path_or_unset,
        "write a Chrome-trace timeline of training steps and bucket communication to this file on rank 0",
    )
    collective_timeout: float = _option(
        600.0,
        _number(float, 0.0, float("inf"), low_open=True),
        "seconds a collective may wait for its peers before the job fails naming the cause "
        "(torch's defaults: 600 for NCCL, whose watchdog then ends the process, 1800 for Gloo; hangs are named "
        "sooner by hang_timeout); applies to process groups started without an explicit timeout",
    )
    hang_timeout: float | str = _option(
        "auto",
        _keyword_or("auto", _number(float, 0.0, float("inf")), "auto, or a number >= 0 (seconds; 0: off)"),
        "seconds after which a rank that stopped training while its peers wait is named and the job ended on every "
        "node; auto: max(60, 10 x the median step time), from the third step on",
    )
    log_level: str = _option(
        "info",
        _choice("debug", "info", "warning", "error"),
        "level of trainaccel's own log lines",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, f.metadata["parse"](f.name, getattr(self, f.name)))

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @staticmethod
    def env_name(option: str) -> str:
        return ENV_PREFIX + option.upper()

    @staticmethod
    def flag_name(option: str) -> str:
        return "--" + option.replace("_", "-")

    @classmethod
    def add_arguments(cls, parser: Any, suffix: str = "") -> None:
        """Add a flag per option to an argparse parser, in a group per topic (dest `trainaccel_<option>`)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for topic, names in TOPICS.items():
            group = parser.add_argument_group(topic + suffix)
            for name in names:
                f = fields[name]
                kwargs: dict[str, Any] = {"dest": f"trainaccel_{name}"}
                if f.metadata["switch"] is not None:
                    # A bare switch: an optional value would swallow the training script's name.
                    kwargs.update(action="store_const", const=f.metadata["switch"])
                else:
                    kwargs["metavar"] = getattr(f.metadata["parse"], "metavar", None) or _metavar(
                        f.metadata["parse"].annotation
                    )
                group.add_argument(cls.flag_name(name), *f.metadata["aliases"], help=cls.help_for(name), **kwargs)
                if "_" in name:  # --sync_every works as torchrun's --nproc_per_node does; the help shows one spelling
                    group.add_argument("--" + name, help=argparse.SUPPRESS, **kwargs)

    @classmethod
    def flags_from(cls, args: Any) -> dict[str, Any]:
        """The option values that `add_arguments` flags set on parsed `args` (None where unset)."""
        return {name: getattr(args, f"trainaccel_{name}") for name in cls.option_names()}

    @classmethod
    def help_for(cls, option: str) -> str:
        f = next(f for f in dataclasses.fields(cls) if f.name == option)
        default = "empty" if f.default is None else f.default
        parse = f.metadata["parse"]
        # Choices alone are in the flag's placeholder already; ranges and keywords-or-numbers are not.
        choices_only = re.fullmatch(r"Literal\[[^]]*\]( \| bool)?", parse.annotation)
        return f"{f.metadata['help']} [{'' if choices_only else parse.accepted + '; '}default: {default}]"

    @classmethod
    def resolve(
        cls,
        env: Mapping[str, str] | None = None,
        flags: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Config:
        """Merge defaults < env < flags < keywords, validating each value where it came from."""
        env = os.environ if env is None else env
        unknown = sorted(set(kwargs) - set(cls.option_names()))
        if unknown:
            hint = did_you_mean(unknown[0], cls.option_names())
            raise TypeError(f"unknown trainaccel option(s) {unknown}{hint}; known: {', '.join(cls.option_names())}")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            candidates = [
                (kwargs.get(f.name), "keyword"),
                ((flags or {}).get(f.name), cls.flag_name(f.name)),
                (env.get(cls.env_name(f.name)), cls.env_name(f.name)),
            ]
            for raw, source in candidates:
                if raw is not None:
                    try:
                        values[f.name] = f.metadata["parse"](f.name, raw)
                    except ConfigError as e:
                        raise ConfigError(e.option, e.value, e.accepted, source) from None
                    break
        config = cls(**values)
        high, low = config.compression_ratio_max, config.compression_ratio
        if high is not None and high <= low:
            raise ConfigError("compression_ratio_max", high, f"a number above compression_ratio={low:g}, or empty")
        steps_apart = {"sync_scope": "auto", "sync_warmup": 0, "sync_fragments": 1, "sync_overlap": 0}
        for option, off in steps_apart.items():
            if not config.sync_every and getattr(config, option) != off:
                raise ConfigError(option, getattr(config, option), f"{off} without sync_every, whose syncs it shapes")
        if isinstance(config.sync_every, int) and config.sync_every:
            every = config.sync_every
            if config.sync_fragments > every:
                raise ConfigError(
                    "sync_fragments",
                    config.sync_fragments,
                    f"at most sync_every={every}: each fragment syncs at its own step of every {every}",
                )
            if config.sync_overlap > every:
                raise ConfigError(
                    "sync_overlap",
                    config.sync_overlap,
                    f"at most sync_every={every}: a fragment's sync is applied by the time its next one starts",
                )
        if config.on_lost_replica == "continue" and not config.sync_every:
            # Per-step survivors average each step's gradients among the replicas present, flat and in float32.
            for option, (off, why) in _PER_STEP_SURVIVORS_ACCEPT.items():
                value = getattr(config, option)
                if value not in off:
                    shown = ", ".join("empty" if a is None else str(a) for a in off)
                    raise ConfigError(
                        option,
                        value,
                        f"{shown} with on_lost_replica=continue without sync_every ({why})",
                    )
        if config.shard != "off":
            _check_shard(config)
        if config.sync_every:
            # These act on the per-step gradient exchange, which sync_every switches off: refused, not ignored.
            per_step = {"compression": "none", "local_steps": 1, "autotune": "off"}
            for option, off in per_step.items():
                value = getattr(config, option)
                if value != off:
                    raise ConfigError(
                        option,
                        value,
                        f"{off} with sync_every={config.sync_every}, which switches off the per-step gradient "
                        f"exchange that {option} applies to",
                    )
        return config

    @classmethod
    def unknown_env(cls, env: Mapping[str, str] | None = None) -> list[str]:
        """TRAINACCEL_* variables that name neither an option nor a setting in ENV_SETTINGS (likely typos)."""
        env = os.environ if env is None else env
        known = {cls.env_name(n) for n in [*cls.option_names(), *ENV_SETTINGS]}
        return sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)

    @classmethod
    def misspelt_env(cls, env: Mapping[str, str] | None = None) -> list[str]:
        """A line for each TRAINACCEL_* variable that names no option or setting, naming the closest."""
        known = [cls.env_name(n) for n in [*cls.option_names(), *ENV_SETTINGS]]
        return [f"{name} is not a trainaccel option{did_you_mean(name, known)}" for name in cls.unknown_env(env)]

    @classmethod
    def check_env(cls, env: Mapping[str, str] | None = None) -> list[str]:
        """Refuse a TRAINACCEL_* variable that names no option or setting, in one line naming the closest (unless
        TRAINACCEL_UNKNOWN_ENV=warn: then returns the lines to warn with)."""
        env = os.environ if env is None else env
        lines = cls.misspelt_env(env)
        setting = (env.get(cls.env_name("unknown_env")) or "error").strip().lower()
        if setting not in ("error", "warn"):
            raise ConfigError("unknown_env", setting, "error, warn", cls.env_name("unknown_env"))
        if lines and setting == "error":
            raise ConfigError.line(f"{lines[0]}; set {cls.env_name('unknown_env')}=warn to ignore it")
        return lines

    def to_env(self, options: Iterable[str] | None = None) -> dict[str, str]:
        """The TRAINACCEL_* variables that reproduce this config (or only `options` of it) in another process."""
        values = dataclasses.asdict(self)
        names = list(values) if options is None else list(options)
        unknown = set(names) - set(values)
        if unknown:
            raise TypeError(f"unknown trainaccel option(s) {sorted(unknown)}; known: {', '.join(values)}")
        return {self.env_name(name): "" if values[name] is None else str(values[name]) for name in names}

    def describe(self) -> str:
        """One line of the options that differ from their defaults, e.g. `compression=fp16 sync_every=4`."""
        default = Config()
        changed = [
            f"{f.name}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        ]
        return " ".join(changed) or "the defaults"


def env_setting(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The TRAINACCEL_<NAME> variable of a setting in ENV_SETTINGS; None where unset or empty."""
    if name not in ENV_SETTINGS:
        raise KeyError(f"unknown trainaccel setting {name!r}; known: {', '.join(ENV_SETTINGS)}")
    return (os.environ if env is None else env).get(Config.env_name(name)) or None


# on_lost_replica=continue without sync_every: each step's exchange among the replicas present (comm/survivors.py)
# is flat and exact; what acts on trainaccel's per-step hook or on DDP's own exchange is refused, each with why.
_PER_STEP_SURVIVORS_ACCEPT: dict[str, tuple[tuple[Any, ...], str]] = {
    "compression": (("none",), "its exchange among the replicas present is exact; sync_every carries outer codecs"),
    "intra_compression": (("none",), "its exchange is flat"),
    "hierarchical": (("auto", "off"), "its exchange is flat"),
    "local_steps": ((1,), "use the script's no_sync()"),
    "autotune": (("off",), "it times DDP's reductions"),
    "nan_check": (("off",), "it checks trainaccel's per-step hook"),
    "straggler_every": ((0,), "it times trainaccel's per-step hook"),
    "timeline": ((None,), "it traces trainaccel's per-step hook"),
}


# Under shard, FSDP2 reduces the gradients: options of DDP's gradient exchange are refused, each with why.
_SHARD_ACCEPTS: dict[str, tuple[tuple[Any, ...], str]] = {
    "intra_compression": (("none",), "FSDP2 reduces within a node"),
    "hierarchical": (("auto", "off"), "shard=hybrid is the two-level form"),
    "sync_warmup": ((0,), "its steps would need DDP's per-step exchange"),
    "sync_scope": (("auto", "node"), "shard=hybrid reduces within each node at every step"),
    "local_steps": ((1,), "use the script's no_sync()"),
    "on_lost_replica": (("stop",), "a sharded replica's workers exchange at every step"),
    "autotune": (("off",), "it times DDP's reductions"),
    "bucket_mb": ((None,), "FSDP2 reduces block by block, sized by shard_min_params"),
    "amp": (("off", "bf16"), "bf16 is FSDP2's MixedPrecisionPolicy; fp16 would need loss scaling"),
    "amp_policy": (("always",), "FSDP2's precision is fixed when the model is sharded"),
    "compile": (("off",), "not built for sharded models yet"),
    "nan_check": (("off",), "it checks DDP's buckets"),
    "metrics_every": ((0,), "it measures DDP's steps"),
    "straggler_every": ((0,), "it times DDP's gradient exchange"),
    "timeline": ((None,), "it traces DDP's buckets"),
}


def _check_shard(config: Config) -> None:
    codecs = ("none", "fp16", "bf16") if config.shard == "hybrid" else ("none",)
    if config.compression not in codecs:
        why = "the cross-node sum of whole gradient shards" if config.shard == "hybrid" else "use shard=hybrid"
        raise ConfigError("compression", config.compression, f"{', '.join(codecs)} with shard={config.shard} ({why})")
    if config.sync_every and config.shard != "hybrid":
        raise ConfigError("sync_every", config.sync_every, "0 with shard=full (no replicas to sync: use shard=hybrid)")
    for option, (accepted, why) in _SHARD_ACCEPTS.items():
        value = getattr(config, option)
        if value not in accepted:
            shown = ", ".join("empty" if a is None else str(a) for a in accepted)
            raise ConfigError(option, value, f"{shown} with shard={config.shard} ({why})")
