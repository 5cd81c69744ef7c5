"""Calibration of the dense path: the bisection asks few questions and finds the first winning size;
the answer is measured once per machine and key, then read back from the kernel cache."""

from __future__ import annotations

import json

import pytest
import torch

from stages.engine.runner import calibration
from stages.engine.runner.calibration import calibrate_dense_min_rows, first_win
from stages.engine.runner.quant import GroupInt4, QuantLinear

ROWS = (4, 16, 64, 128, 192, 256)


@pytest.mark.parametrize("cross", [None, 4, 16, 64, 128, 192, 256])
def test_bisection_finds_the_first_winning_size_in_few_questions(cross: int | None) -> None:
    asked: list[int] = []

    def wins(n: int) -> bool:
        asked.append(n)
        return cross is not None and n >= cross

    assert first_win(ROWS, wins) == cross
    assert asked[0] == 256
    assert len(asked) == 1 if cross is None else 2 <= len(asked) <= 4  # 1 + ceil(log2(6))
    assert len(set(asked)) == len(asked)


def _layers() -> list[QuantLinear]:
    from stages.engine.runner.kernels import quant_matmul

    kernel = quant_matmul()
    if kernel is None:
        pytest.skip("the block kernel cannot be built here (no C++ compiler)")
    torch.manual_seed(0)
    return [QuantLinear(GroupInt4.quantize(torch.randn(64, 128) * 0.05), None, dense_min_rows=8, block_kernel=kernel)
            for _ in range(2)]


def test_measured_once_per_key_then_read_from_the_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LIFECYCLE_KERNEL_CACHE", str(tmp_path))
    measured: list[tuple[int, ...]] = []
    answers = {ROWS: 64, ROWS[:3]: None}

    def measure(layers, rows, repeats):
        measured.append(rows)
        return answers[rows]

    monkeypatch.setattr(calibration, "measure_dense_min_rows", measure)
    layers = _layers()
    assert calibrate_dense_min_rows(layers, ROWS) == 64
    assert calibrate_dense_min_rows(layers, ROWS) == 64
    assert measured == [ROWS]
    (cached,) = tmp_path.glob("calibration-*.json")
    assert json.loads(cached.read_text()) == {"dense_min_rows": 64}

    # Another key (here the sizes tried) is measured on its own, a None answer kept too.
    assert calibrate_dense_min_rows(layers, ROWS[:3]) is None
    assert calibrate_dense_min_rows(layers, ROWS[:3]) is None
    assert measured == [ROWS, ROWS[:3]]

    # A torn or foreign file is measured again and replaced.
    cached.write_text("{")
    assert calibrate_dense_min_rows(layers, ROWS) == 64
    assert measured == [ROWS, ROWS[:3], ROWS]
    assert json.loads(cached.read_text()) == {"dense_min_rows": 64}


def test_the_real_measurement_answers_a_size_tried_or_none(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LIFECYCLE_KERNEL_CACHE", str(tmp_path))
    assert calibrate_dense_min_rows(_layers(), ROWS, repeats=1) in (*ROWS, None)
    assert len(list(tmp_path.glob("calibration-*.json"))) == 1
