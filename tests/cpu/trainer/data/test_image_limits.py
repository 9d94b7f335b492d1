"""What a data file's images may be (docs/vision-language.md#data, issue 57): at most
``data.max_image_pixels`` pixels, checked from the image's header before any pixel is decoded
(a decompression bomb is one line, not a traceback or gigabytes of memory), and, as file paths,
inside the data file's folder unless ``data.allow_image_paths_outside=true``: a path elsewhere
(``../``, absolute, ``/proc/...``, a symbolic link out) is refused before the file is opened.
Also: ``data.task=count_squares`` with a text model names the fix."""
from __future__ import annotations

import json
import os
import struct
import warnings
import zlib

import pytest
from PIL import Image

from polyfsdp.trainer.config.sections import DataSection
from polyfsdp.trainer.data import images as images_module
from polyfsdp.trainer.data.images import DEFAULT_MAX_IMAGE_PIXELS, PIL_MAX_PIXELS, ImagePolicy
from polyfsdp.trainer.data.sources import read_jsonl
from polyfsdp.trainer.errors import DataError
from polyfsdp.trainer.train import main


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def blank_png(width: int, height: int) -> bytes:
    """A valid black 1-bit PNG of ``width`` x ``height``: a 30000x30000 one is 110 KB and takes
    well under a second to write (PIL would first allocate its 900 MB of pixels)."""
    row = b"\0" * (1 + (width + 7) // 8)  # filter byte 0, then the row's bits
    z = zlib.compressobj(9)
    body = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # bit depth 1, greyscale
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", body) + _chunk(b"IEND", b"")


def write_records(path, images) -> str:
    """A JSONL file of 3 records, each with ``images``."""
    path.write_text("".join(json.dumps({"prompt": "n?", "answer": "1", "images": images}) + "\n" for _ in range(3)))
    return str(path)


def one_line_error(capsys, args) -> str:
    """``polyfsdp-train args``'s stderr, checked to be one line after a non-zero exit."""
    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1, err[-3000:]
    return err


def job(path, tmp_path, *extra) -> list[str]:
    return ["model=qwen2_vl", "data=jsonl", f"data.path={path}", "data.eval_size=1", "trainer.progress=off",
            f"trainer.output_dir={tmp_path / 'run'}", *extra]


def test_the_default_cap_covers_what_the_processors_keep_and_stays_under_pils_refusal():
    # Qwen2-VL's and Qwen2.5-VL's released checkpoints keep at most 12845056 pixels (max_pixels:
    # 16384 tokens of 28x28); larger images are scaled down to that anyway.
    assert DataSection().max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS == 4096 * 4096 >= 28 * 28 * 16384
    assert PIL_MAX_PIXELS == 2 * Image.MAX_IMAGE_PIXELS  # PIL refuses more, whatever the cap


def test_a_decompression_bomb_is_one_line_at_the_command_line(tmp_path, capsys):
    """The issue's 30000x30000 PNG: a 59-line DecompressionBombError traceback before."""
    (tmp_path / "bomb.png").write_bytes(blank_png(30000, 30000))
    path = write_records(tmp_path / "train.jsonl", ["bomb.png"])
    err = one_line_error(capsys, job(path, tmp_path))
    assert f"{path} line 1: field 'images' item 0 (file {tmp_path / 'bomb.png'}) is an image of 900000000 pixels, " \
           f"more than data.max_image_pixels={DEFAULT_MAX_IMAGE_PIXELS}; shrink it" in err, err
    assert err.endswith(f"; PIL decodes at most {PIL_MAX_PIXELS} pixels, whatever the cap")  # no cap would do
    assert "Traceback" not in err and not (tmp_path / "run" / "init_model").exists()


def test_an_image_over_the_cap_is_refused_from_its_header_in_one_line(tmp_path, capsys, monkeypatch):
    """The issue's 12000x12000 PNG: accepted before at 2.5 GB of memory (and PIL's two-line
    DecompressionBombWarning). Now refused before any pixel is decoded."""
    (tmp_path / "big.png").write_bytes(blank_png(12000, 12000))
    path = write_records(tmp_path / "train.jsonl", ["big.png"])
    decoded = []
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(self.size) or pytest.fail("decoded"))
    err = one_line_error(capsys, job(path, tmp_path))
    assert f"{path} line 1: field 'images' item 0 (file {tmp_path / 'big.png'}) is a 12000x12000 image " \
           f"(144000000 pixels), more than data.max_image_pixels={DEFAULT_MAX_IMAGE_PIXELS}; shrink it " in err, err
    assert err.endswith(" or raise data.max_image_pixels"), err
    assert "DecompressionBombWarning" not in err and not decoded


@pytest.mark.parametrize("size, fits", [((4096, 4096), True), ((4096, 4097), False)])
def test_an_image_at_the_default_cap_passes_and_one_row_more_does_not(tmp_path, size, fits):
    (tmp_path / "a.png").write_bytes(blank_png(*size))
    path = write_records(tmp_path / "t.jsonl", ["a.png"])
    if fits:
        assert read_jsonl(path)[0].images[0].size == size
    else:
        with pytest.raises(DataError, match=r"is a 4096x4097 image \(16781312 pixels\), more than "
                                            r"data.max_image_pixels=16777216; "):
            read_jsonl(path)


@pytest.mark.parametrize("form", ["path", "bytes", "base64"])
def test_the_configured_cap_holds_for_every_form_of_image(tmp_path, form):
    import base64

    data = blank_png(28, 29)
    (tmp_path / "a.png").write_bytes(data)
    # "bytes": a datasets struct, its bytes as base64 text (JSON holds no raw bytes).
    value = {"path": "a.png", "bytes": {"bytes": base64.b64encode(data).decode(), "path": None},
             "base64": base64.b64encode(data).decode()}[form]
    path = write_records(tmp_path / "t.jsonl", [value])
    assert read_jsonl(path, images=ImagePolicy(max_pixels=28 * 29))[0].images[0].size == (28, 29)  # at the cap
    with pytest.raises(DataError) as info:
        read_jsonl(path, images=ImagePolicy(max_pixels=28 * 29 - 1))
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{path} line 1: field 'images' item 0") and \
        "is a 28x29 image (812 pixels), more than data.max_image_pixels=811; shrink it" in text, text


def test_the_cap_is_a_data_key_with_a_range(tmp_path, capsys):
    (tmp_path / "a.png").write_bytes(blank_png(28, 28))
    path = write_records(tmp_path / "t.jsonl", ["a.png"])
    err = one_line_error(capsys, job(path, tmp_path, "data.max_image_pixels=100"))
    assert "is a 28x28 image (784 pixels), more than data.max_image_pixels=100" in err
    err = one_line_error(capsys, job(path, tmp_path, f"data.max_image_pixels={PIL_MAX_PIXELS + 1}"))
    assert err.startswith("polyfsdp-train: error: data.max_image_pixels") and str(PIL_MAX_PIXELS) in err, err
    err = one_line_error(capsys, job(path, tmp_path, "data.max_image_pixels=0"))
    assert "data.max_image_pixels" in err, err


def test_pils_own_bomb_limits_are_one_line_or_silent_under_a_raised_cap(tmp_path, monkeypatch):
    """PIL warns over Image.MAX_IMAGE_PIXELS and refuses over twice that whatever the cap: with
    the cap raised the warning is not printed (the cap decided), and the refusal is one line."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    (tmp_path / "warned.png").write_bytes(blank_png(40, 40))  # 1600 pixels: PIL warns
    (tmp_path / "refused.png").write_bytes(blank_png(50, 50))  # 2500 pixels: PIL refuses
    policy = ImagePolicy(max_pixels=10_000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ex = read_jsonl(write_records(tmp_path / "w.jsonl", ["warned.png"]), images=policy)[0]
    assert ex.images[0].size == (40, 40)
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    path = write_records(tmp_path / "r.jsonl", ["refused.png"])
    with pytest.raises(DataError) as info:
        read_jsonl(path, images=policy)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{path} line 1: field 'images' item 0 (file ") and \
        "is an image of 2500 pixels, more than PIL decodes (2000" in text, text


@pytest.fixture
def outside(tmp_path):
    """A data folder ``data/`` with one image inside, and an image beside it, outside."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "in.png").write_bytes(blank_png(28, 28))
    (tmp_path / "secret.png").write_bytes(blank_png(28, 28))
    return tmp_path


def _spy_opens(monkeypatch) -> list[str]:
    """The files the image reader opens (its own ``open`` and PIL's)."""
    opened = []
    real_open = open

    def spy(file, *args, **kwargs):
        opened.append(os.path.realpath(file) if isinstance(file, (str, os.PathLike)) else file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(images_module, "open", spy, raising=False)
    monkeypatch.setattr(Image, "open", lambda fp, *a, **k: opened.append(fp) or _real_image_open(fp, *a, **k))
    return opened


_real_image_open = Image.open


@pytest.mark.parametrize("name", ["relative", "absolute", "proc", "link"])
def test_a_path_outside_the_data_folder_is_refused_before_it_is_opened(outside, monkeypatch, name):
    (outside / "data" / "link.png").symlink_to(outside / "secret.png")
    value = {"relative": "../secret.png", "absolute": str(outside / "secret.png"), "proc": "/proc/self/cmdline",
             "link": "link.png"}[name]
    path = write_records(outside / "data" / "t.jsonl", [value])
    opened = _spy_opens(monkeypatch)
    with pytest.raises(DataError) as info:
        read_jsonl(path)
    text = str(info.value)
    resolved = os.path.realpath(os.path.join(outside / "data", value))
    assert "\n" not in text and text.startswith(f"{path} line 1: field 'images' item 0: {value!r} is {resolved}, "
                                                f"outside the data file's folder {outside / 'data'}; ") and \
        "data.allow_image_paths_outside=true" in text, text
    assert opened == [], opened  # refused from its name alone: nothing was read


def test_a_path_outside_is_one_line_at_the_command_line(outside, capsys):
    path = write_records(outside / "data" / "t.jsonl", ["/proc/self/cmdline"])
    err = one_line_error(capsys, job(path, outside))
    assert f"{path} line 1: field 'images' item 0: '/proc/self/cmdline' is " in err and \
        "data.allow_image_paths_outside=true" in err, err


def test_allowing_paths_outside_reads_them(outside):
    (outside / "data" / "link.png").symlink_to(outside / "secret.png")
    path = write_records(outside / "data" / "t.jsonl", ["../secret.png", "link.png", str(outside / "secret.png"),
                                                        "in.png"])
    with pytest.raises(DataError):
        read_jsonl(path)
    ex = read_jsonl(path, images=ImagePolicy(paths_outside=True))[0]
    assert [image.size for image in ex.images] == [(28, 28)] * 4


def test_paths_inside_the_folder_pass_also_through_links_and_dot_dots(outside):
    (outside / "data" / "pics").mkdir()
    (outside / "data" / "pics" / "link.png").symlink_to(outside / "data" / "in.png")
    absolute = str(outside / "data" / "in.png")
    path = write_records(outside / "data" / "t.jsonl", ["pics/../in.png", "pics/link.png", absolute])
    assert [image.size for image in read_jsonl(path)[0].images] == [(28, 28)] * 3


def test_a_data_file_in_the_working_directory_reads_its_images_there(outside, monkeypatch):
    monkeypatch.chdir(outside / "data")
    write_records(outside / "data" / "t.jsonl", ["in.png"])
    assert read_jsonl("t.jsonl")[0].images[0].size == (28, 28)
    write_records(outside / "data" / "o.jsonl", ["../secret.png"])
    with pytest.raises(DataError, match=r"^o.jsonl line 1: field 'images' item 0: '../secret.png' is .*, outside "
                                        r"the data file's folder"):
        read_jsonl("o.jsonl")


def test_a_fifo_in_the_folder_is_refused_without_opening_it(outside, monkeypatch):
    """Opening a FIFO for reading would wait for a writer for ever."""
    os.mkfifo(outside / "data" / "pipe.png")
    path = write_records(outside / "data" / "t.jsonl", ["pipe.png"])
    opened = _spy_opens(monkeypatch)
    with pytest.raises(DataError, match=r"line 1: field 'images' item 0: .*pipe.png' is not a regular file"):
        read_jsonl(path)
    assert opened == []


def test_count_squares_with_a_text_model_names_the_fix(tmp_path, capsys):
    err = one_line_error(capsys, ["data.task=count_squares", f"trainer.output_dir={tmp_path / 'run'}"])
    assert err.startswith("polyfsdp-train: error: data.task=count_squares: ") and "model=qwen2_vl" in err and \
        "task=count_squares" in err, err
    assert not (tmp_path / "run").exists()


def test_image_records_for_a_text_model_name_the_fix(tmp_path, capsys):
    (tmp_path / "a.png").write_bytes(blank_png(28, 28))
    path = write_records(tmp_path / "t.jsonl", ["a.png"])
    err = one_line_error(capsys, ["data=jsonl", f"data.path={path}", "data.eval_size=1",
                                  f"trainer.output_dir={tmp_path / 'run'}"])
    assert f"{path} line 1: field 'images': the record has 1 images, but the model has no image processor" in err
    assert "model=qwen2_vl" in err and "model.path=" in err, err
