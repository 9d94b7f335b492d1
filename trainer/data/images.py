"""A data record's images (docs/vision-language.md): the ``images`` field (a list, verl's name) or
``image`` (one, TRL's), decoded with PIL, and where they sit in the prompt.

Each image is a file path (relative to the data file's directory), raw bytes, a base64 string
(optionally a ``data:image/...;base64,`` URL), or Hugging Face datasets' image struct
``{"bytes": ..., "path": ...}`` (what a parquet file written by ``datasets`` holds). A prompt
message's content may be a list of parts, ``{"type": "image"}`` and ``{"type": "text", "text":
...}``: the k-th image part takes the k-th image. A record that only lists images gets them as
image parts in front of its first user message's text. Every malformed field is one
:class:`~polyfsdp.trainer.errors.DataError` line naming the record and the field.
"""
from __future__ import annotations

import base64
import binascii
import io
import os

from ..errors import DataError
from .demonstrations import plain_value

IMAGE_FIELDS = ("images", "image")
_DATA_URL = "data:image/"


def _open(data: bytes, what: str, where: str):
    """A decoded RGB-able PIL image of ``data``; DataError naming ``what`` when PIL cannot read it."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()  # decode now: a truncated file fails here, not inside the processor
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise DataError(f"{where}: {what} is not an image PIL can read ({' '.join(str(exc).split())[:80]})") from None
    return image


def _from_text(value: str, what: str, where: str, base_dir: str):
    """A path (relative to ``base_dir``), a data URL, or base64 text."""
    if value.startswith(_DATA_URL):
        head, _, payload = value.partition(",")
        if not head.endswith(";base64"):
            raise DataError(f"{where}: {what} is a data URL without ';base64' ({head[:40]!r})")
        return _open(_base64(payload, what, where), what, where)
    path = value if os.path.isabs(value) else os.path.join(base_dir, value)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return _open(f.read(), f"{what} (file {path})", where)
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        data = None  # not base64: a path that names no file
    if data:
        return _open(data, f"{what} (base64)", where)
    raise DataError(f"{where}: {what}: no file {path!r} (paths are relative to the data file's directory), "
                    f"and not base64 image data")


def _base64(payload: str, what: str, where: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise DataError(f"{where}: {what} holds data that is not base64") from None


def decode_image(value, what: str, where: str, base_dir: str):
    """One image of a record (module docstring's forms) as a PIL image."""
    value = plain_value(value)
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        if value.get("bytes") is not None:
            return decode_image(value["bytes"], what, where, base_dir)
        if isinstance(value.get("path"), str):
            return decode_image(value["path"], what, where, base_dir)
        raise DataError(f"{where}: {what} is an image struct with neither bytes nor a path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _open(bytes(value), what, where)
    if isinstance(value, str):
        return _from_text(value, what, where, base_dir)
    raise DataError(f"{where}: {what} must be a file path, bytes, base64 text or {{\"bytes\", \"path\"}}, "
                    f"got {type(value).__name__}")


def read_images(raw: dict, where: str, base_dir: str) -> tuple:
    """The decoded images of record ``raw`` (none: an empty tuple)."""
    present = [name for name in IMAGE_FIELDS if raw.get(name) is not None]
    if len(present) > 1:
        raise DataError(f"{where}: has both fields 'images' and 'image'; give one")
    if not present:
        return ()
    name = present[0]
    value = plain_value(raw[name])
    if name == "image":
        return (decode_image(value, "field 'image'", where, base_dir),)
    if not isinstance(value, list):
        raise DataError(f"{where}: field 'images' must be a list of images, got {type(value).__name__}")
    return tuple(decode_image(v, f"field 'images' item {k}", where, base_dir) for k, v in enumerate(value))


def content_parts(content, where: str, key: str, index: int) -> tuple:
    """A message's list content as ``({"type": "image"} | {"type": "text", "text": str}, ...)``."""
    out = []
    for j, part in enumerate(plain_value(content)):
        part = plain_value(part)
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            out.append({"type": "image"})
        elif kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        else:
            raise DataError(f"{where}: field {key!r} message {index} part {j} must be {{\"type\": \"image\"}} or "
                            f"{{\"type\": \"text\", \"text\": text}}, got {str(part)[:80]}")
    return tuple(out)


def message_text(message: dict) -> str:
    """A message's text: its content, or its text parts joined."""
    content = message["content"]
    return content if isinstance(content, str) else "".join(p["text"] for p in content if p["type"] == "text")


def place_images(messages: tuple, count: int, where: str, key: str) -> tuple:
    """``messages`` with ``count`` images placed: as the image parts the messages hold (their
    number must be ``count``), else in front of the first user message's text."""
    parts = sum(1 for m in messages if not isinstance(m["content"], str) for p in m["content"] if p["type"] == "image")
    if parts:
        if parts != count:
            raise DataError(f"{where}: field {key!r} has {parts} image parts, but the record gives {count} images "
                            f"(field 'images'); each image part takes one image, in order")
        return messages
    if not count:
        return messages
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise DataError(f"{where}: field {key!r} has no user message to put the record's {count} images in")
    first = users[0]
    message = messages[first]
    content = message["content"]
    text = ({"type": "text", "text": content},) if isinstance(content, str) else tuple(content)
    placed = {**message, "content": ({"type": "image"},) * count + text}
    return messages[:first] + (placed,) + messages[first + 1:]
