"""A resumed run reads the metrics.jsonl records its checkpoint counted (issue 38, item 8): a torn
last line (a killed run's partial write) is dropped with one printed line and the run continues;
a damaged line with records after it is one DataError naming the file and the line."""
import json

import pytest

from polyfsdp.trainer.errors import DataError
from polyfsdp.trainer.tracking.metrics import MetricsLogger


def _write(path, lines):
    path.write_text("".join(lines))


def _record(step):
    return json.dumps({"phase": "sft", "step": step, "global_step": step}) + "\n"


def test_a_torn_last_line_is_dropped_with_one_line_and_the_next_record_starts_a_line(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    _write(path, [_record(0), _record(1), '{"phase": "sft", "st'])
    logger = MetricsLogger(str(path))
    logger.start(keep_lines=3)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path} line 3 is a torn last record" in err
    assert logger.lines == 2 and [r["step"] for r in logger.history] == [0, 1]
    logger.log({"phase": "sft", "step": 2, "global_step": 2})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]


def test_a_kept_last_line_without_its_newline_gets_one_before_the_next_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [_record(0), _record(1).rstrip("\n")])
    logger = MetricsLogger(str(path))
    logger.start(keep_lines=2)
    logger.log({"phase": "sft", "step": 2, "global_step": 2})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]


@pytest.mark.parametrize("damaged", ['{"phase": "sf\n', "[1, 2]\n"], ids=["torn_json", "not_a_record"])
def test_a_damaged_line_in_the_middle_is_one_data_error_naming_file_and_line(tmp_path, damaged):
    path = tmp_path / "metrics.jsonl"
    _write(path, [_record(0), "\n", damaged, _record(2)])
    with pytest.raises(DataError) as raised:
        MetricsLogger(str(path)).start(keep_lines=3)
    message = str(raised.value)
    assert f"{path} line 3 is not a JSON record" in message and "\n" not in message
    assert path.read_text().count("\n") == 4  # nothing was rewritten
