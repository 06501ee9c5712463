"""`tf.train.Example` messages without TensorFlow, and the conventional image keys.

The message types are built at import from their description (TensorFlow's feature.proto and
example.proto) in a private descriptor pool, so they do not clash with TensorFlow or another
package that registers the same names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory


def _message_classes() -> dict[str, type]:
    F = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(
        name="trainaccel/tf_example.proto", package="tensorflow", syntax="proto3"
    )

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> descriptor_pb2.DescriptorProto:
        msg = proto.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            msg.field.add(name=field_name, number=number, type=kind, label=label, type_name=type_name or None)
        return msg

    repeated, optional = F.LABEL_REPEATED, F.LABEL_OPTIONAL
    message("BytesList", ("value", 1, F.TYPE_BYTES, repeated, ""))
    message("FloatList", ("value", 1, F.TYPE_FLOAT, repeated, ""))
    message("Int64List", ("value", 1, F.TYPE_INT64, repeated, ""))
    feature = message(
        "Feature",
        ("bytes_list", 1, F.TYPE_MESSAGE, optional, ".tensorflow.BytesList"),
        ("float_list", 2, F.TYPE_MESSAGE, optional, ".tensorflow.FloatList"),
        ("int64_list", 3, F.TYPE_MESSAGE, optional, ".tensorflow.Int64List"),
    )
    feature.oneof_decl.add(name="kind")
    for field in feature.field:
        field.oneof_index = 0
    features = message("Features", ("feature", 1, F.TYPE_MESSAGE, repeated, ".tensorflow.Features.FeatureEntry"))
    entry = features.nested_type.add(name="FeatureEntry")  # how protobuf spells map<string, Feature>
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=optional)
    entry.field.add(name="value", number=2, type=F.TYPE_MESSAGE, label=optional, type_name=".tensorflow.Feature")
    entry.options.map_entry = True
    message("Example", ("features", 1, F.TYPE_MESSAGE, optional, ".tensorflow.Features"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"tensorflow.{name}"))
        for name in ("Example", "Feature")
    }


_CLASSES = _message_classes()
Example, Feature = _CLASSES["Example"], _CLASSES["Feature"]

Value = Union[bytes, str, int, float]


def encode_example(features: Mapping[str, Value | Sequence[Value] | np.ndarray]) -> bytes:
    """A serialized Example: bytes and str become bytes_list, int int64_list, float float_list.

    A NumPy array gives its kind by dtype, so an empty list of floats stays a float_list.
    """
    example = Example()
    for key, value in features.items():
        target = example.features.feature[key]
        if isinstance(value, np.ndarray):
            if value.dtype.kind == "f":
                target.float_list.value.extend(value.ravel().tolist())
            elif value.dtype.kind in "iu":
                target.int64_list.value.extend(value.ravel().tolist())
            elif value.dtype.kind in "OSU":
                target.bytes_list.value.extend(v.encode() if isinstance(v, str) else bytes(v) for v in value.ravel())
            else:
                raise ValueError(
                    f"feature {key!r}: arrays of dtype {value.dtype} are not accepted; use float, int or object arrays"
                )
            continue
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if all(isinstance(v, (bytes, str)) for v in values) and values:
            target.bytes_list.value.extend(v.encode() if isinstance(v, str) else v for v in values)
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            target.int64_list.value.extend(values)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            target.float_list.value.extend(float(v) for v in values)
        else:
            kinds = sorted({type(v).__name__ for v in values})
            raise ValueError(
                f"feature {key!r} has values of types {kinds}; accepted: all bytes/str, all int, or all float"
            )
    return example.SerializeToString(deterministic=True)  # map keys sorted: the same bytes in every process


def decode_example(payload: bytes) -> dict[str, list[Any]]:
    """An Example's features as lists of bytes, int or float."""
    example = Example.FromString(payload)
    out: dict[str, list[Any]] = {}
    for key, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        out[key] = list(getattr(feature, kind).value) if kind else []
    return out


@dataclass
class ImageRecord:
    """One image as stored in a shard, with the conventional keys."""

    encoded: bytes
    label: int
    format: str = "jpeg"
    height: int = 0
    width: int = 0
    filename: str = ""

    def to_example(self, **extra: Value | Sequence[Value]) -> bytes:
        return encode_example(
            {
                "image/encoded": self.encoded,
                "image/format": self.format,
                "image/class/label": self.label,
                "image/height": self.height,
                "image/width": self.width,
                "image/filename": self.filename,
                **extra,
            }
        )

    @classmethod
    def from_example(cls, payload: bytes) -> "ImageRecord":
        features = decode_example(payload)
        if "image/encoded" not in features:
            raise ValueError(f"not an image record: no 'image/encoded' among {sorted(features)}")

        def one(key: str, default: Any) -> Any:
            values = features.get(key) or [default]
            return values[0]

        fmt, name = one("image/format", b"jpeg"), one("image/filename", b"")
        return cls(
            encoded=features["image/encoded"][0],
            label=int(one("image/class/label", -1)),
            format=fmt.decode() if isinstance(fmt, bytes) else str(fmt),
            height=int(one("image/height", 0)),
            width=int(one("image/width", 0)),
            filename=name.decode() if isinstance(name, bytes) else str(name),
        )
