"""Tests that only mean something on a CUDA device. Every test here gets the ``gpu`` marker and skips
where torch sees no CUDA device (tests/conftest.py).

None yet, on purpose: the engine's CUDA checks are the same checks as on CPU, so they stay one body
each in ``tests/parity/test_parity.py`` and ``tests/unit/engine/runner/test_flex_paged.py``, which
take their device from ``LIFECYCLE_TEST_DEVICE`` (cpu by default); ``scripts/gpu_check.sh`` runs
them with ``LIFECYCLE_TEST_DEVICE=cuda``. A check with no CPU counterpart belongs here.
"""
