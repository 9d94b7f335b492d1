"""A data record's images (docs/vision-language.md): the ``images`` field (a list, verl's name) or
``image`` (one, TRL's), decoded with PIL, and where they sit in the prompt.

Each image is a file path (relative to the data file's directory), raw bytes, a base64 string
(optionally a ``data:image/...;base64,`` URL), or Hugging Face datasets' image struct
``{"bytes": ..., "path": ...}`` (what a parquet file written by ``datasets`` holds). A prompt
message's content may be a list of parts, ``{"type": "image"}`` and ``{"type": "text", "text":
...}``: the k-th image part takes the k-th image. A record that only lists images gets them as
image parts in front of its first user message's text. Every malformed field is one
:class:`~polyfsdp.trainer.errors.DataError` line naming the record and the field.

A data file is input the user may not have written (a downloaded dataset), so what it makes us
read is bounded (:class:`ImagePolicy`): an image's size is read from its header and checked
against ``data.max_image_pixels`` before a pixel is decoded (a small PNG can claim 30000x30000
pixels: gigabytes once decoded), and a path must resolve, links followed, to a regular file
inside the data file's folder unless ``data.allow_image_paths_outside=true``; both are checked
before the file is opened (``../../etc/passwd``, ``/proc/self/...``, a FIFO that would block).
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import os
import re
import stat
import warnings

from ..errors import DataError
from .demonstrations import plain_value

IMAGE_FIELDS = ("images", "image")
_DATA_URL = "data:image/"
# data.max_image_pixels's default: 4096x4096. The largest image the Qwen VL processors keep is
# 12845056 pixels (the max_pixels of Qwen2-VL's and Qwen2.5-VL's released checkpoints: 16384
# tokens of 28x28; transformers' own defaults are smaller); they scale larger images down to it,
# so more pixels cost decoding memory (3 bytes each, and float copies in the processor) and bring
# no detail. 4096x4096 is above that, and above a 12-megapixel photo (4032x3024).
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
# PIL refuses to decode more pixels than this (twice Image.MAX_IMAGE_PIXELS, its
# DecompressionBombError) whatever data.max_image_pixels says: the key's upper bound.
PIL_MAX_PIXELS = 2 * 89_478_485
_PIL_PIXELS = re.compile(r"\((\d+) pixels\)")
# What a job with images needs, said where a text model meets them (the job's config for data.task=count_squares,
# the prompt encoder for a record's images).
VISION_MODEL_FIX = ("add model=qwen2_vl (the tiny Qwen2-VL preset; model.preset=qwen2.5-vl-tiny or qwen3-vl-tiny for "
                    "the other families) or give model.path=DIR of a Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint with "
                    "its preprocessor_config.json")


@dataclasses.dataclass(frozen=True)
class ImagePolicy:
    """What a data file's images may be: at most ``max_pixels`` (``data.max_image_pixels``), and
    file paths only inside the data file's folder unless ``paths_outside``
    (``data.allow_image_paths_outside``)."""

    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    paths_outside: bool = False


def _too_large(what: str, where: str, size: str, pixels: int, policy: ImagePolicy) -> DataError:
    from PIL import Image

    most = 2 * Image.MAX_IMAGE_PIXELS if Image.MAX_IMAGE_PIXELS else None  # what PIL decodes at most
    fix = " or raise data.max_image_pixels" if most is None or pixels <= most else \
        f"; PIL decodes at most {most} pixels, whatever the cap"
    return DataError(f"{where}: {what} is {size}, more than data.max_image_pixels={policy.max_pixels}; shrink it "
                     f"(the model's processor scales images down to its max_pixels anyway){fix}")


def _open(source, what: str, where: str, policy: ImagePolicy, decode: bool = True):
    """The PIL image of ``source`` (bytes, or an open binary file), its size checked against
    ``policy`` from the header before it is decoded (``decode=False``: only that check);
    DataError naming ``what`` when PIL cannot read it or it is too large."""
    from PIL import Image, UnidentifiedImageError

    stream = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        with warnings.catch_warnings():
            # PIL warns over Image.MAX_IMAGE_PIXELS: the cap below decides (a user may raise it).
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(stream)  # lazy: reads the header, not the pixels
            width, height = image.size
            if width * height > policy.max_pixels:
                raise _too_large(what, where, f"a {width}x{height} image ({width * height} pixels)", width * height,
                                 policy)
            if decode:
                image.load()  # decode now: a truncated file fails here, not inside the processor
    except DataError:
        raise  # (a ValueError: not PIL's)
    except Image.DecompressionBombError as exc:  # over PIL's own limit, checked in Image.open
        found = _PIL_PIXELS.search(str(exc))
        size = f"an image of {found.group(1)} pixels" if found else "an image"
        if found and int(found.group(1)) > policy.max_pixels:
            raise _too_large(what, where, size, int(found.group(1)), policy) from None
        raise DataError(f"{where}: {what} is {size}, more than PIL decodes ({2 * Image.MAX_IMAGE_PIXELS} pixels, "
                        f"its decompression-bomb limit, whatever data.max_image_pixels says); shrink it") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise DataError(f"{where}: {what} is not an image PIL can read ({' '.join(str(exc).split())[:80]})") from None
    return image


def _image_file(value: str, what: str, where: str, base_dir: str, policy: ImagePolicy) -> str | None:
    """The resolved path of the file ``value`` names (relative to ``base_dir``), checked against
    ``policy`` from its name and metadata only (nothing is opened); None when it names nothing."""
    path = os.path.join(base_dir, value)  # an absolute value stays itself
    if not os.path.lexists(path):
        return None
    resolved = os.path.realpath(path)
    folder = os.path.realpath(base_dir or os.curdir)
    if not policy.paths_outside and os.path.commonpath([folder, resolved]) != folder:
        raise DataError(f"{where}: {what}: {value!r} is {resolved}, outside the data file's folder {folder}; "
                        f"images are read only from inside it: move the image there, or set "
                        f"data.allow_image_paths_outside=true if you trust this data file")
    try:
        mode = os.stat(resolved).st_mode
    except OSError:  # a dangling link
        return None
    if not stat.S_ISREG(mode):
        raise DataError(f"{where}: {what}: {path!r} is not a regular file (a directory, FIFO or device); "
                        f"give an image file")
    return resolved


def _from_text(value: str, what: str, where: str, base_dir: str, policy: ImagePolicy):
    """A path (relative to ``base_dir``), a data URL, or base64 text."""
    if value.startswith(_DATA_URL):
        head, _, payload = value.partition(",")
        if not head.endswith(";base64"):
            raise DataError(f"{where}: {what} is a data URL without ';base64' ({head[:40]!r})")
        return _open(_base64(payload, what, where), what, where, policy)
    path = os.path.join(base_dir, value)
    resolved = _image_file(value, what, where, base_dir, policy)
    if resolved is not None:
        with open(resolved, "rb") as f:
            _open(f, f"{what} (file {path})", where, policy, decode=False)  # its header's size first
            f.seek(0)
            data = f.read()
        return _open(data, f"{what} (file {path})", where, policy)  # held in memory: no file stays open
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        data = None  # not base64: a path that names no file
    if data:
        return _open(data, f"{what} (base64)", where, policy)
    raise DataError(f"{where}: {what}: no file {path!r} (paths are relative to the data file's directory), "
                    f"and not base64 image data")


def _base64(payload: str, what: str, where: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise DataError(f"{where}: {what} holds data that is not base64") from None


def decode_image(value, what: str, where: str, base_dir: str, policy: ImagePolicy = ImagePolicy()):
    """One image of a record (module docstring's forms) as a PIL image, within ``policy``."""
    value = plain_value(value)
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        if value.get("bytes") is not None:
            return decode_image(value["bytes"], what, where, base_dir, policy)
        if isinstance(value.get("path"), str):
            return decode_image(value["path"], what, where, base_dir, policy)
        raise DataError(f"{where}: {what} is an image struct with neither bytes nor a path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _open(bytes(value), what, where, policy)
    if isinstance(value, str):
        return _from_text(value, what, where, base_dir, policy)
    raise DataError(f"{where}: {what} must be a file path, bytes, base64 text or {{\"bytes\", \"path\"}}, "
                    f"got {type(value).__name__}")


def read_images(raw: dict, where: str, base_dir: str, policy: ImagePolicy = ImagePolicy()) -> tuple:
    """The decoded images of record ``raw`` (none: an empty tuple), within ``policy``."""
    present = [name for name in IMAGE_FIELDS if raw.get(name) is not None]
    if len(present) > 1:
        raise DataError(f"{where}: has both fields 'images' and 'image'; give one")
    if not present:
        return ()
    name = present[0]
    value = plain_value(raw[name])
    if name == "image":
        return (decode_image(value, "field 'image'", where, base_dir, policy),)
    if not isinstance(value, list):
        raise DataError(f"{where}: field 'images' must be a list of images, got {type(value).__name__}")
    return tuple(decode_image(v, f"field 'images' item {k}", where, base_dir, policy)
                 for k, v in enumerate(value))


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
